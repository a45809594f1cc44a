//! The worker API over TLS, with a certificate the operator issues itself.
//!
//! The chart generates a CA once (`ca.crt`, `ca.key` in a Secret mounted
//! only into the operator). At start each operator replica makes a fresh
//! serving key and a certificate for the names workers reach it by (the
//! worker API Service's cluster IP, which is known only once the operator
//! has read the Service, and its DNS names), signed by that CA. Workers are
//! given the CA certificate (public) with the URL and trust nothing else for
//! this API, so every replica behind the Service is verified alike and a
//! pod that answers in its place is not.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::ServerConfig;

/// The CA certificate file in the CA directory.
pub const CA_CERT_FILE: &str = "ca.crt";
/// The CA key file in the CA directory (PKCS#1 RSA, as Helm's `genCA`
/// writes it, or PKCS#8).
pub const CA_KEY_FILE: &str = "ca.key";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    Parse { path: String, detail: String },
    #[error("issuing the worker API's certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("the worker API's TLS configuration: {0}")]
    Config(#[from] tokio_rustls::rustls::Error),
}

/// What the worker API serves with, and what workers verify it by.
#[derive(Clone)]
pub struct ServingTls {
    /// For [`crate::listener::serve`].
    pub config: Arc<ServerConfig>,
    /// The CA certificate, PEM: handed to workers (no secret).
    pub ca_pem: String,
}

impl std::fmt::Debug for ServingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingTls").finish_non_exhaustive()
    }
}

impl ServingTls {
    /// A fresh serving key and a certificate for `hosts` (IP addresses or
    /// DNS names), signed by the CA in `ca_dir`.
    pub fn issue(ca_dir: &Path, hosts: &[String]) -> Result<Self, TlsError> {
        let read = |name: &str| {
            let path = ca_dir.join(name);
            std::fs::read(&path).map_err(|source| TlsError::Read {
                path: path.display().to_string(),
                source,
            })
        };
        let parse = |name: &str, detail: String| TlsError::Parse {
            path: ca_dir.join(name).display().to_string(),
            detail,
        };
        let ca_pem = read(CA_CERT_FILE)?;
        let ca_cert = CertificateDer::from_pem_slice(&ca_pem)
            .map_err(|e| parse(CA_CERT_FILE, format!("not a PEM certificate: {e}")))?;
        let ca_key = match PrivateKeyDer::from_pem_slice(&read(CA_KEY_FILE)?)
            .map_err(|e| parse(CA_KEY_FILE, format!("not a PEM private key: {e}")))?
        {
            PrivateKeyDer::Pkcs8(k) => k,
            PrivateKeyDer::Pkcs1(k) => {
                PrivatePkcs8KeyDer::from(rsa_pkcs1_to_pkcs8(k.secret_pkcs1_der()))
            }
            _ => {
                return Err(parse(
                    CA_KEY_FILE,
                    "an EC key in SEC1 form: give an RSA key or any key as PKCS#8".into(),
                ));
            }
        };
        let ca_key = KeyPair::try_from(&ca_key)?;
        let issuer = Issuer::from_ca_cert_der(&ca_cert, ca_key)?;

        let mut params = CertificateParams::new(hosts.to_vec())?;
        params
            .distinguished_name
            .push(DnType::CommonName, "headroom worker API");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        // A process's certificate lives as long as its key: the process.
        // A year bounds what a copied one is worth.
        let year = jiff::Timestamp::now()
            .to_zoned(jiff::tz::TimeZone::UTC)
            .year();
        params.not_before = rcgen::date_time_ymd(i32::from(year) - 1, 1, 1);
        params.not_after = rcgen::date_time_ymd(i32::from(year) + 1, 1, 1);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;

        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone(), ca_cert], key_der)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServingTls {
            config: Arc::new(config),
            ca_pem: String::from_utf8_lossy(&ca_pem).into_owned(),
        })
    }
}

/// The names a certificate for the worker API Service `service` in
/// `namespace` with cluster IP `ip` carries.
pub fn service_hosts(service: &str, namespace: &str, ip: Option<IpAddr>) -> Vec<String> {
    let mut hosts: Vec<String> = ip.map(|ip| ip.to_string()).into_iter().collect();
    hosts.extend([
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]);
    hosts
}

/// Wraps a PKCS#1 RSAPrivateKey in a PKCS#8 PrivateKeyInfo (RFC 5208):
/// SEQUENCE { INTEGER 0, SEQUENCE { OID rsaEncryption, NULL }, OCTET STRING key }.
/// ring signs only with PKCS#8 keys; Helm's `genCA` writes PKCS#1.
fn rsa_pkcs1_to_pkcs8(pkcs1: &[u8]) -> Vec<u8> {
    fn tlv(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let len = body.len();
        if len < 0x80 {
            out.push(len as u8);
        } else {
            let bytes: Vec<u8> = len
                .to_be_bytes()
                .into_iter()
                .skip_while(|b| *b == 0)
                .collect();
            out.push(0x80 | bytes.len() as u8);
            out.extend(bytes);
        }
        out.extend_from_slice(body);
        out
    }
    // 1.2.840.113549.1.1.1 and NULL parameters.
    const RSA_ALGORITHM: [u8; 15] = [
        0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00,
    ];
    let mut body = vec![0x02, 0x01, 0x00];
    body.extend_from_slice(&RSA_ALGORITHM);
    body.extend(tlv(0x04, pkcs1));
    tlv(0x30, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA as the chart makes it (Helm's `genCA`: RSA 2048, PKCS#1),
    /// rendered once by `helm template` into this fixture.
    const HELM_CA_CERT: &str = include_str!("testdata/helm-ca.crt");
    const HELM_CA_KEY: &str = include_str!("testdata/helm-ca.key");

    fn ca_dir(name: &str, cert: &str, key: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hr-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join(CA_CERT_FILE), cert).expect("cert");
        std::fs::write(dir.join(CA_KEY_FILE), key).expect("key");
        dir
    }

    #[test]
    fn a_helm_made_ca_issues_a_certificate_for_the_services_names() {
        assert!(
            HELM_CA_KEY.contains("BEGIN RSA PRIVATE KEY"),
            "PKCS#1, as genCA writes it"
        );
        let dir = ca_dir("helm", HELM_CA_CERT, HELM_CA_KEY);
        let hosts = service_hosts(
            "hr-worker-api",
            "headroom-system",
            "10.96.0.20".parse().ok(),
        );
        let tls = ServingTls::issue(&dir, &hosts).expect("issued");
        assert_eq!(tls.ca_pem.trim(), HELM_CA_CERT.trim());
        assert_eq!(tls.config.alpn_protocols, vec![b"http/1.1".to_vec()]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_missing_or_wrong_ca_names_the_file() {
        let dir = ca_dir("bad", "not a certificate", HELM_CA_KEY);
        let err = ServingTls::issue(&dir, &[]).expect_err("bad cert");
        assert!(err.to_string().contains("ca.crt"), "{err}");
        std::fs::remove_file(dir.join(CA_KEY_FILE)).ok();
        std::fs::write(dir.join(CA_CERT_FILE), HELM_CA_CERT).expect("cert");
        let err = ServingTls::issue(&dir, &[]).expect_err("no key");
        assert!(err.to_string().contains("ca.key"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn pkcs1_wrapping_matches_a_pkcs8_encoder() {
        // Short and long (multi-byte length) bodies alike.
        let short = rsa_pkcs1_to_pkcs8(&[1, 2, 3]);
        assert_eq!(short[..2], [0x30, 3 + 15 + 5]);
        let long = rsa_pkcs1_to_pkcs8(&[7; 1200]);
        assert_eq!(long[..4], [0x30, 0x82, 0x04, 0xc6]);
        assert_eq!(long.len(), 4 + 3 + 15 + 4 + 1200);
    }
}
