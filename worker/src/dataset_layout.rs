//! Which files of a dataset repository hold a split, found as Hugging Face's
//! `datasets` library finds them for `load_dataset(repo, subset, split=...)`
//! (its `data_files.py`), so a job names a Hub dataset the way its card
//! does. In order:
//!
//! 1. the README's YAML `configs`: the subset's `data_files` (a pattern,
//!    a list, or `{split, path}` entries; relative to its `data_dir`);
//! 2. `data/<split>-NNNNN-of-NNNNN*.*` shards (what `push_to_hub` writes);
//! 3. directories, then files, named after the split's keywords (`train`,
//!    `training`; `validation`, `valid`, `dev`, `val`; `test`, `testing`,
//!    `eval`, `evaluation`), each followed by one of `-._ 0-9`;
//! 4. every data file, as `train`.
//!
//! The same function reads the hub's listing (the initializer, before it
//! downloads) and the download directory (the workers, after), so both see
//! the same files: each step's files are a predicate on the path, and the
//! directory holds only what the listing chose.

use glob::{MatchOptions, Pattern};
use headroom_api::DataSplit;

use crate::text::Format;

/// Files `datasets` never reads as data.
const FILES_TO_IGNORE: [&str; 6] = [
    "README.md",
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dummy_data.zip",
    "dataset_dict.json",
];

/// A dataset card: the file the `configs` are declared in.
pub const README: &str = "README.md";

/// The pushed shards of any split.
const SHARDED: &str = "data/*-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*";

/// The default splits and their keywords, in `datasets`' order.
const KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// The characters that may follow (or precede) a split keyword in a name.
const SEPARATOR: &str = "[-._ 0-9]";

/// `fsspec`'s (and Python's) glob: `*` stays inside one path component,
/// `**` spans components.
const GLOB: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

/// The extensions the worker reads in `format`, as `datasets` names them.
pub fn extensions(format: &Format) -> &'static [&'static str] {
    match format {
        Format::Jsonl { .. } => &["jsonl", "json"],
        Format::Parquet { .. } => &["parquet"],
        Format::PlainText => &["txt"],
    }
}

/// The files of `split` among `files` (paths relative to the repository's
/// root, `/`-separated), with the README's text when there is one; in the
/// order they are read. Errors say what the repository has instead.
pub fn split_files(
    files: &[String],
    readme: Option<&str>,
    split: &DataSplit,
    format: &Format,
) -> Result<Vec<String>, String> {
    let candidates: Vec<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| is_data_candidate(f))
        .collect();
    let configs = readme.map(configs).transpose()?.unwrap_or_default();
    let chosen = if configs.is_empty() {
        if let Some(subset) = &split.subset {
            return Err(format!(
                "subset {subset}: the dataset's README declares no configs (its YAML header's `configs:`); leave subset out, or name the files with file"
            ));
        }
        default_split_files(&candidates, &split.split)?
    } else {
        let config = pick_config(&configs, split.subset.as_deref())?;
        config_split_files(config, &candidates, &split.split)?
    };
    check_extensions(&chosen, &split.split, format)?;
    Ok(chosen)
}

/// Whether `path` may be data: not a card or metadata file, not hidden, not
/// in a `__special__` directory, not one of the initializer's unfinished
/// downloads (`.part`).
fn is_data_candidate(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let name = parts.last().copied().unwrap_or_default();
    !FILES_TO_IGNORE.contains(&name)
        && !name.ends_with(".part")
        && !parts.iter().any(|p| p.starts_with('.'))
        && !parts[..parts.len() - 1].iter().any(|p| p.starts_with("__"))
}

/// The candidates `pattern` matches, in name order.
fn resolve(pattern: &str, candidates: &[&str]) -> Result<Vec<String>, String> {
    let compiled =
        Pattern::new(pattern).map_err(|e| format!("data_files pattern {pattern:?}: {e}"))?;
    let mut found: Vec<String> = candidates
        .iter()
        .filter(|c| compiled.matches_with(c, GLOB))
        .map(|c| c.to_string())
        .collect();
    found.sort();
    Ok(found)
}

/// The names a glob pattern (`data/train-*.parquet`) matches, in name order.
pub fn matching(pattern: &str, names: &[String]) -> Result<Vec<String>, String> {
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    resolve(pattern, &names)
}

/// The files of several patterns, each pattern's in name order, each file once.
fn resolve_all(patterns: &[String], candidates: &[&str]) -> Result<Vec<String>, String> {
    let mut files: Vec<String> = Vec::new();
    for pattern in patterns {
        for f in resolve(pattern, candidates)? {
            if !files.contains(&f) {
                files.push(f);
            }
        }
    }
    Ok(files)
}

/// Steps 2–4 of the module doc over `candidates`.
fn default_split_files(candidates: &[&str], split: &str) -> Result<Vec<String>, String> {
    let shards = resolve(SHARDED, candidates)?;
    if !shards.is_empty() {
        let mut splits: Vec<String> = shards
            .iter()
            .filter_map(|f| f.rsplit('/').next()?.split('-').next().map(str::to_string))
            .collect();
        splits.sort();
        splits.dedup();
        if !splits.iter().any(|s| s == split) {
            return Err(format!(
                "split {split}: the dataset's shards (data/<split>-NNNNN-of-NNNNN) are of the splits {}",
                splits.join(", ")
            ));
        }
        let pattern = SHARDED.replacen('*', split, 1);
        return resolve(&pattern, candidates);
    }
    for in_dir_names in [true, false] {
        let mut found: Vec<(&str, Vec<String>)> = Vec::new();
        for (name, keywords) in KEYWORDS {
            let files = resolve_all(&keyword_patterns(keywords, in_dir_names), candidates)?;
            if !files.is_empty() {
                found.push((name, files));
            }
        }
        if found.is_empty() {
            continue;
        }
        let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
        return found
            .into_iter()
            .find(|(n, _)| *n == split)
            .map(|(_, files)| files)
            .ok_or_else(|| {
                format!(
                    "split {split}: the dataset's {} are named after the splits {}",
                    if in_dir_names { "directories" } else { "files" },
                    names.join(", ")
                )
            });
    }
    if candidates.is_empty() {
        return Err("the dataset has no data files".into());
    }
    if split != "train" {
        return Err(format!(
            "split {split}: the dataset's files are not named after splits, so they are all train"
        ));
    }
    resolve("**", candidates)
}

/// `datasets`' patterns of a split's keywords in directory or file names.
fn keyword_patterns(keywords: &[&str], in_dir_names: bool) -> Vec<String> {
    let s = SEPARATOR;
    keywords
        .iter()
        .flat_map(|k| {
            if in_dir_names {
                vec![
                    format!("**/{k}/**"),
                    format!("**/{k}{s}*/**"),
                    format!("**/*{s}{k}/**"),
                    format!("**/*{s}{k}{s}*/**"),
                ]
            } else {
                vec![format!("**/{k}{s}*"), format!("**/*{s}{k}{s}*")]
            }
        })
        .collect()
}

/// One entry of the README's `configs`.
#[derive(Clone, Debug, PartialEq)]
struct Config {
    name: String,
    default: bool,
    data_dir: Option<String>,
    /// Split → patterns; `None` when the config gives only a `data_dir`.
    data_files: Option<Vec<(String, Vec<String>)>>,
}

/// The `configs` of a dataset card's YAML header (empty without one).
fn configs(readme: &str) -> Result<Vec<Config>, String> {
    let Some(rest) = readme
        .strip_prefix("---\n")
        .or_else(|| readme.strip_prefix("---\r\n"))
    else {
        return Ok(Vec::new());
    };
    let Some(end) = rest.find("\n---") else {
        return Ok(Vec::new());
    };
    let header: serde_yaml::Value =
        serde_yaml::from_str(&rest[..end]).map_err(|e| format!("{README}'s YAML header: {e}"))?;
    let Some(list) = header.get("configs") else {
        return Ok(Vec::new());
    };
    let bad = |what: &str| format!("{README}: configs {what}");
    let list = list.as_sequence().ok_or_else(|| bad("is not a list"))?;
    list.iter()
        .map(|c| {
            let name = c
                .get("config_name")
                .and_then(serde_yaml::Value::as_str)
                .unwrap_or("default")
                .to_string();
            let data_files = c
                .get("data_files")
                .map(|d| data_files(d).map_err(|e| bad(&format!("{name}: data_files {e}"))))
                .transpose()?;
            Ok(Config {
                default: c.get("default").and_then(serde_yaml::Value::as_bool) == Some(true),
                data_dir: c
                    .get("data_dir")
                    .and_then(serde_yaml::Value::as_str)
                    .map(|d| d.trim_matches('/').to_string()),
                name,
                data_files,
            })
        })
        .collect()
}

/// A `data_files` value as split → patterns (`datasets`' `sanitize_patterns`).
fn data_files(value: &serde_yaml::Value) -> Result<Vec<(String, Vec<String>)>, String> {
    use serde_yaml::Value;
    let strings = |v: &Value| -> Result<Vec<String>, String> {
        match v {
            Value::String(s) => Ok(vec![s.clone()]),
            Value::Sequence(items) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_string)
                        .ok_or("a path that is not text".into())
                })
                .collect(),
            _ => Err("a path that is neither text nor a list".into()),
        }
    };
    match value {
        Value::String(_) => Ok(vec![("train".into(), strings(value)?)]),
        Value::Sequence(items) if items.iter().all(Value::is_string) => {
            Ok(vec![("train".into(), strings(value)?)])
        }
        Value::Sequence(items) => items
            .iter()
            .map(|entry| {
                let split = entry.get("split").and_then(Value::as_str);
                let path = entry.get("path");
                match (split, path) {
                    (Some(split), Some(path)) => Ok((split.to_string(), strings(path)?)),
                    _ => Err("entries need split and path".to_string()),
                }
            })
            .collect(),
        Value::Mapping(map) => map
            .iter()
            .map(|(k, v)| {
                let split = k.as_str().ok_or("a split name that is not text")?;
                Ok((split.to_string(), strings(v)?))
            })
            .collect(),
        _ => Err("is neither a pattern, a list nor a mapping".into()),
    }
}

/// The config `subset` names, or the default one.
fn pick_config<'c>(configs: &'c [Config], subset: Option<&str>) -> Result<&'c Config, String> {
    let names = || {
        configs
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match subset {
        Some(subset) => configs.iter().find(|c| c.name == subset).ok_or_else(|| {
            format!("subset {subset}: the dataset's configs are {}", names())
        }),
        None => configs
            .iter()
            .find(|c| c.default)
            .or_else(|| configs.iter().find(|c| c.name == "default"))
            .or_else(|| (configs.len() == 1).then(|| &configs[0]))
            .ok_or_else(|| {
                format!(
                    "the dataset has several configs and none is the default: set subset to one of {}",
                    names()
                )
            }),
    }
}

/// The files of `split` in `config`: its patterns (under its `data_dir`), or
/// the default layout inside its `data_dir`.
fn config_split_files(
    config: &Config,
    candidates: &[&str],
    split: &str,
) -> Result<Vec<String>, String> {
    let prefix = config.data_dir.as_ref().map(|d| format!("{d}/"));
    let Some(splits) = &config.data_files else {
        let Some(prefix) = &prefix else {
            return default_split_files(candidates, split);
        };
        let inside: Vec<&str> = candidates
            .iter()
            .filter_map(|c| c.strip_prefix(prefix.as_str()))
            .collect();
        return default_split_files(&inside, split)
            .map(|files| files.into_iter().map(|f| format!("{prefix}{f}")).collect());
    };
    let Some((_, patterns)) = splits.iter().find(|(s, _)| s == split) else {
        let names: Vec<&str> = splits.iter().map(|(s, _)| s.as_str()).collect();
        return Err(format!(
            "split {split}: config {} has the splits {}",
            config.name,
            names.join(", ")
        ));
    };
    let patterns: Vec<String> = patterns
        .iter()
        .map(|p| {
            format!(
                "{}{}",
                prefix.as_deref().unwrap_or(""),
                p.trim_start_matches("./")
            )
        })
        .collect();
    let files = resolve_all(&patterns, candidates)?;
    if files.is_empty() {
        return Err(format!(
            "split {split} of config {}: no file of the dataset matches {}",
            config.name,
            patterns.join(", ")
        ));
    }
    Ok(files)
}

/// Every file of the split is of `format`; otherwise say which format it is.
fn check_extensions(files: &[String], split: &str, format: &Format) -> Result<(), String> {
    let wanted = extensions(format);
    let Some(other) = files
        .iter()
        .find(|f| !wanted.iter().any(|e| f.ends_with(&format!(".{e}"))))
    else {
        return Ok(());
    };
    let kind = [
        (
            Format::Parquet {
                field: String::new(),
            },
            "format: parquet",
        ),
        (
            Format::Jsonl {
                field: String::new(),
            },
            "format: jsonl",
        ),
        (Format::PlainText, "format: text"),
    ]
    .into_iter()
    .find(|(f, _)| {
        extensions(f)
            .iter()
            .any(|e| other.ends_with(&format!(".{e}")))
    })
    .map(|(_, set)| format!("; set data.{set}"))
    .unwrap_or_else(|| {
        "; Headroom reads JSONL (.jsonl, .json), Parquet (.parquet) and plain text (.txt)".into()
    });
    Err(format!(
        "split {split} holds {other}, which data.format does not read ({}){kind}",
        wanted
            .iter()
            .map(|e| format!(".{e}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn split(name: &str) -> DataSplit {
        DataSplit {
            subset: None,
            split: name.into(),
        }
    }

    fn parquet() -> Format {
        Format::Parquet {
            field: "text".into(),
        }
    }

    fn jsonl() -> Format {
        Format::Jsonl {
            field: "text".into(),
        }
    }

    /// `push_to_hub`'s layout: the shards of the split, in order; other
    /// splits named when the asked one is missing.
    #[test]
    fn pushed_shards_are_found_by_their_split() {
        let repo = files(&[
            ".gitattributes",
            "README.md",
            "data/test_sft-00000-of-00001.parquet",
            "data/train_sft-00001-of-00002.parquet",
            "data/train_sft-00000-of-00002.parquet",
            "data/train_sft-00000-of-00002.parquet.part",
        ]);
        assert_eq!(
            split_files(&repo, None, &split("train_sft"), &parquet()).expect("train_sft"),
            files(&[
                "data/train_sft-00000-of-00002.parquet",
                "data/train_sft-00001-of-00002.parquet",
            ])
        );
        let e = split_files(&repo, None, &split("train"), &parquet()).expect_err("no train");
        assert!(e.contains("test_sft, train_sft"), "{e}");
        let e = split_files(&repo, None, &split("train_sft"), &jsonl()).expect_err("parquet");
        assert!(e.contains("set data.format: parquet"), "{e}");
    }

    /// Files and directories named after a split's keywords, as `datasets`
    /// matches them (a separator after the keyword; directories first).
    #[test]
    fn splits_named_in_files_and_directories() {
        let by_name = files(&["train.jsonl", "dev.jsonl", "test.jsonl", "trainer.jsonl"]);
        assert_eq!(
            split_files(&by_name, None, &split("train"), &jsonl()).expect("train"),
            files(&["train.jsonl"])
        );
        assert_eq!(
            split_files(&by_name, None, &split("validation"), &jsonl()).expect("dev"),
            files(&["dev.jsonl"])
        );
        let nested = files(&[
            "chat/my-train-1.jsonl",
            "training/a.jsonl",
            "training/b/c.jsonl",
            "eval/x.jsonl",
        ]);
        // Directory names win over file names.
        assert_eq!(
            split_files(&nested, None, &split("train"), &jsonl()).expect("train"),
            files(&["training/a.jsonl", "training/b/c.jsonl"])
        );
        let e = split_files(&nested, None, &split("validation"), &jsonl()).expect_err("none");
        assert!(
            e.contains("directories are named after the splits train, test"),
            "{e}"
        );
        // Nothing named after a split: everything is train.
        let plain = files(&["README.md", "conversations.jsonl", "more/rows.jsonl"]);
        assert_eq!(
            split_files(&plain, None, &split("train"), &jsonl()).expect("all"),
            files(&["conversations.jsonl", "more/rows.jsonl"])
        );
        assert!(split_files(&plain, None, &split("test"), &jsonl()).is_err());
    }

    /// The README's configs: the default one, a named subset, `data_dir`,
    /// patterns and lists; a missing subset or split names what there is.
    #[test]
    fn readme_configs_pick_the_files() {
        let readme = "---\nlicense: mit\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n    path: data/train_sft-*\n  - split: test_sft\n    path: [data/test_sft-*]\n- config_name: fr\n  data_dir: fr\n- config_name: de\n  data_files: de/*.parquet\n---\n# Card\n";
        let repo = files(&[
            "README.md",
            "data/train_sft-00000-of-00001.parquet",
            "data/test_sft-00000-of-00001.parquet",
            "fr/train-00000-of-00001.parquet",
            "fr/data/validation-00000-of-00001.parquet",
            "de/a.parquet",
            "de/b.parquet",
        ]);
        let read = |subset: Option<&str>, name: &str| {
            split_files(
                &repo,
                Some(readme),
                &DataSplit {
                    subset: subset.map(str::to_string),
                    split: name.into(),
                },
                &parquet(),
            )
        };
        assert_eq!(
            read(None, "train_sft").expect("default config"),
            files(&["data/train_sft-00000-of-00001.parquet"])
        );
        assert_eq!(
            read(Some("de"), "train").expect("a pattern is train"),
            files(&["de/a.parquet", "de/b.parquet"])
        );
        // data_dir alone: the default layout inside it.
        assert_eq!(
            read(Some("fr"), "validation").expect("fr"),
            files(&["fr/data/validation-00000-of-00001.parquet"])
        );
        let e = read(Some("es"), "train").expect_err("no es");
        assert!(e.contains("configs are default, fr, de"), "{e}");
        let e = read(None, "train").expect_err("no train in default");
        assert!(e.contains("has the splits train_sft, test_sft"), "{e}");
    }
}
