//! The worker API over TLS on loopback: the operator issues its serving
//! certificate from a CA made as the chart makes it (Helm's `genCA`), and a
//! client that trusts that CA alone reaches the API; one that trusts
//! another CA, or asks for a name the certificate does not carry, does not
//! get as far as a request.

use std::sync::Arc;
use std::time::Duration;

use headroom_operator::listener::{Limits, serve};
use headroom_operator::worker_api::{self, OperatorKey, ServingTls};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

const HELM_CA_CERT: &str = include_str!("../src/worker_api/testdata/helm-ca.crt");
const HELM_CA_KEY: &str = include_str!("../src/worker_api/testdata/helm-ca.key");

async fn start(hosts: &[&str]) -> (std::net::SocketAddr, ServingTls) {
    let dir =
        std::env::temp_dir().join(format!("hr-tls-it-{}-{}", std::process::id(), hosts.len()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("ca.crt"), HELM_CA_CERT).expect("cert");
    std::fs::write(dir.join("ca.key"), HELM_CA_KEY).expect("key");
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    let tls = ServingTls::issue(&dir, &hosts).expect("issued");
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let app = worker_api::router(
        client.clone(),
        OperatorKey::random().expect("key"),
        worker_api::WorkerReports::start(client, Duration::from_secs(10)),
        Default::default(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve(
        listener,
        app,
        Limits::WORKER_API,
        Some(tls.config.clone()),
    ));
    (addr, tls)
}

fn trusting(ca_pem: &str) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("pem"))
        .expect("root");
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// The status line of `GET /v1/peer-key` over TLS as `name`, or the error.
async fn call(
    addr: std::net::SocketAddr,
    name: &str,
    tls: &TlsConnector,
) -> Result<String, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    let mut stream = tokio::time::timeout(Duration::from_secs(5), tls.connect(name, tcp))
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer).await;
    Ok(String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string())
}

#[tokio::test]
async fn only_a_client_trusting_the_charts_ca_reaches_the_api_by_its_names() {
    let (addr, tls) = start(&["127.0.0.1", "hr-worker-api.headroom-system.svc"]).await;
    let good = trusting(&tls.ca_pem);
    // By IP (what workers use) and by the Service's DNS name.
    for name in ["127.0.0.1", "hr-worker-api.headroom-system.svc"] {
        let line = call(addr, name, &good).await.expect("reached");
        assert!(line.contains(" 401 "), "{name}: {line}");
    }
    // A name the certificate does not carry.
    let err = call(addr, "10.0.0.1", &good).await.expect_err("wrong name");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // A client trusting another CA.
    let other_key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other = params.self_signed(&other_key).expect("other CA");
    let err = call(addr, "127.0.0.1", &trusting(&other.pem()))
        .await
        .expect_err("other CA");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // Plain HTTP to the TLS port gets no answer from the API.
    let mut plain = TcpStream::connect(addr).await.expect("tcp");
    plain
        .write_all(b"GET /v1/peer-key HTTP/1.1\r\nHost: operator\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer)).await;
    assert!(
        !String::from_utf8_lossy(&answer).contains("401"),
        "plain HTTP was served"
    );
}
