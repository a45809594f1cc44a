//! A safetensors file read one tensor at a time with positional reads
//! (`pread`), the way [`super::hf`] loads a checkpoint: the header is parsed
//! once, and each tensor's bytes are read from the file only when
//! burn-store applies that tensor to the module, into a buffer of the
//! tensor's size, which the conversion (cast, transpose, quantization)
//! consumes before the next tensor is read.
//!
//! Nothing maps the file. A memory map (burn-store's `SafetensorsStore`)
//! keeps every page of the file that has been read resident in the process
//! (`RssFile`) until it is unmapped, so a stage loaded from one file held
//! its whole share of the file besides its weights; with positional reads
//! the process holds the tensor in flight and what the model keeps. The
//! page cache the reads fill is the kernel's, reclaimable, and no
//! process's resident memory (`tests/streaming_load.rs` measures it).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{DType, Shape, TensorData};
use burn_store::burn_pack::{Error as PackError, Tensor as PackTensor};
use safetensors::tensor::{Dtype, Metadata};

use super::hf::HfError;

/// safetensors' own limit on the JSON header (bytes).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Why a safetensors header could not be read.
#[derive(Debug)]
pub enum HeaderError {
    /// The file could not be read.
    Io(std::io::Error),
    /// Its bytes are not a complete header (the problem, in words).
    Bad(String),
}

/// The header of the safetensors file `file` of `len` bytes: the 8-byte
/// little-endian length, then that many bytes of JSON, within the file and
/// safetensors' limit. Returns the parsed header and its length; the
/// tensors' data starts at `8 + length`. The loader and the initializer's
/// inspection both read headers with it.
pub fn read_header(file: &File, len: u64) -> Result<(Metadata, u64), HeaderError> {
    let mut prefix = [0u8; 8];
    file.read_exact_at(&mut prefix, 0).map_err(|_| {
        HeaderError::Bad(format!(
            "{len} bytes, shorter than the 8-byte header length"
        ))
    })?;
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_BYTES || n > len - 8 {
        return Err(HeaderError::Bad(format!(
            "the header length {n} does not fit the file's {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8)
        .map_err(HeaderError::Io)?;
    let metadata = serde_json::from_slice(&header)
        .map_err(|e| HeaderError::Bad(format!("bad header: {e}")))?;
    Ok((metadata, n))
}

/// One safetensors file: its header parsed, its data unread.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: Arc<File>,
    /// Where the data section starts (bytes from the file's start).
    data_start: u64,
    metadata: Metadata,
}

impl SafetensorsFile {
    /// Opens `path` and reads its header (the 8-byte length and the JSON);
    /// a header that does not describe the file's bytes is an error.
    pub fn open(path: &Path) -> Result<Self, HfError> {
        let io = |source| HfError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bad = |problem: String| HfError::Tensors {
            path: path.to_path_buf(),
            problem: format!("not a complete safetensors file: {problem}"),
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let (metadata, n) = read_header(&file, len).map_err(|e| match e {
            HeaderError::Io(e) => io(e),
            HeaderError::Bad(problem) => bad(problem),
        })?;
        let data_start = 8 + n;
        let data_len = len - data_start;
        for (name, info) in metadata.tensors() {
            let (begin, end) = info.data_offsets;
            let expected = info.shape.iter().product::<usize>() * info.dtype.bitsize() / 8;
            if begin > end || end as u64 > data_len || end - begin != expected {
                return Err(bad(format!(
                    "{name}: bytes {begin}..{end} of a {data_len}-byte data section for a {:?} {:?} tensor",
                    info.dtype, info.shape
                )));
            }
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file: Arc::new(file),
            data_start,
            metadata,
        })
    }

    /// Every tensor of the file as a burn-store tensor whose data is read
    /// from the file when it is drawn (each time it is drawn: burn-store
    /// draws a tensor once when it applies it).
    pub fn lazy_tensors(&self) -> Result<Vec<PackTensor>, HfError> {
        let mut tensors = Vec::new();
        for (name, info) in self.metadata.tensors() {
            let dtype = burn_dtype(info.dtype).ok_or_else(|| HfError::Tensors {
                path: self.path.clone(),
                problem: format!("{name}: dtype {:?} is not one burn loads", info.dtype),
            })?;
            let shape = Shape::from(info.shape.clone());
            let (begin, end) = info.data_offsets;
            let offset = self.data_start + begin as u64;
            let (file, path, declared) = (self.file.clone(), self.path.clone(), shape.clone());
            let tensor = name.clone();
            tensors.push(burn_store::bridge::deferred(
                name,
                dtype,
                shape,
                None,
                move || {
                    let mut bytes = vec![0u8; end - begin];
                    file.read_exact_at(&mut bytes, offset).map_err(|e| {
                        PackError::IoError(format!("{}: reading {tensor}: {e}", path.display()))
                    })?;
                    Ok(TensorData::from_bytes_vec(bytes, declared.clone(), dtype))
                },
            ));
        }
        Ok(tensors)
    }
}

/// The burn dtype of a safetensors dtype (`None`: one burn does not load).
fn burn_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, tensors: &[(&str, Vec<f32>, Vec<usize>)]) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, values, _)| values.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, _, shape), bytes)| {
                let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .expect("view");
                (name.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("write");
    }

    /// Each tensor reads back as written, and a truncated file is refused.
    #[test]
    fn reads_each_tensor_and_refuses_a_truncated_file() {
        let dir = std::env::temp_dir().join(format!("headroom-st-reads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("model.safetensors");
        let a: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = vec![-1.0, 2.0, 3.5];
        write(
            &path,
            &[("a", a.clone(), vec![2, 3]), ("b", b.clone(), vec![3])],
        );
        let file = SafetensorsFile::open(&path).expect("open");
        let mut read: Vec<(String, Vec<f32>, Vec<usize>)> = file
            .lazy_tensors()
            .expect("tensors")
            .into_iter()
            .map(|t| {
                let data = burn_store::bridge::into_data(t.clone()).expect("data");
                (
                    t.name.clone(),
                    data.iter::<f32>().collect(),
                    data.shape().to_vec(),
                )
            })
            .collect();
        read.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(
            read,
            vec![("a".into(), a, vec![2, 3]), ("b".into(), b, vec![3])]
        );
        let bytes = std::fs::read(&path).expect("read");
        std::fs::write(&path, &bytes[..bytes.len() - 4]).expect("truncate");
        let err = SafetensorsFile::open(&path).expect_err("truncated");
        assert!(
            err.to_string().contains("not a complete safetensors file"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
