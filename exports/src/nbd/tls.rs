//! TLS for NBD: the server's credentials, loaded from a directory in
//! QEMU's x509 layout and reloadable while the server runs, and the client
//! certificate checks (`--tls-verify-peer`, `--tls-authz`).
//!
//! ```text
//!   DIR/ca-cert.pem      the CA that signs client certificates (and that
//!                        clients trust for the server's)
//!   DIR/server-cert.pem  the server's certificate (chain), leaf first
//!   DIR/server-key.pem   its private key (PKCS#8, PKCS#1 or SEC1)
//!   DIR/ca-crl.pem       optional: revoked client certificates
//! ```
//!
//! Records are encrypted in userspace by rustls (ring's AES-GCM and
//! ChaCha20-Poly1305), TLS 1.3 preferred, 1.2 allowed (the NBD spec
//! requires 1.2). rustls has no TLS-PSK, so nbdkit's `--tls-psk` has no
//! counterpart here.
//!
//! Where the kernel has TLS (`CONFIG_TLS`, probed at load by
//! [`ktls_probe`]), rustls does only the handshake: each connection then
//! hands its keys and record sequence numbers to the socket
//! ([`ktls_install`]) and the data path is the plaintext one, the kernel
//! encrypting as it sends and decrypting as it receives. Where it does not
//! (or `UDM_TLS_RECORDS=user` is set, or the cipher is one kernel TLS
//! lacks), rustls keeps the record layer too.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use udm_core::Error;

pub use super::handshake::TlsMode;

/// Bytes of TLS buffers a connection counts in the in-flight budget once it
/// starts TLS: ciphertext waiting for the socket (at most [`TLS_OUT_LIMIT`])
/// and the record being received and its plaintext (a record is at most
/// 16 KiB of plaintext, 16 KiB + 256 bytes on the wire, both held at once).
pub const TLS_BUFFERS: u64 = TLS_OUT_LIMIT as u64 + (40 << 10);

/// Encrypted bytes a connection holds for the socket before it stops
/// encrypting replies (they wait in their requests' buffers meanwhile).
pub const TLS_OUT_LIMIT: usize = 256 << 10;

/// What `--tls*` asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// Off, on (the client's choice) or require.
    pub mode: TlsMode,
    /// The credentials' directory (QEMU's layout, see the module docs).
    pub creds: PathBuf,
    /// Require a client certificate signed by the CA.
    pub verify_peer: bool,
    /// Admit only client certificates with one of these subject names
    /// (RFC 4514, as `openssl x509 -noout -subject -nameopt RFC2253`
    /// prints them); empty: any the CA signed. Implies `verify_peer`.
    pub authz: Vec<String>,
}

/// A server's TLS: the options and the credentials now in force.
#[derive(Debug)]
pub struct Tls {
    opts: TlsOptions,
    config: RwLock<Arc<rustls::ServerConfig>>,
    record_layer: String,
    ktls: bool,
}

impl Tls {
    /// Loads the credentials `opts` names; an error names the file and
    /// what is wrong with it.
    pub fn load(opts: TlsOptions) -> Result<Arc<Tls>, Error> {
        if opts.mode == TlsMode::Off {
            return Err(Error::invalid("--tls off: nothing to load"));
        }
        let (ktls, record_layer) =
            if std::env::var_os("UDM_TLS_RECORDS").is_some_and(|v| v == "user") {
                (
                    false,
                    "userspace (rustls; UDM_TLS_RECORDS=user)".to_string(),
                )
            } else {
                match ktls_probe() {
                    Ok(()) => (
                        true,
                        "the kernel (kTLS; rustls for the handshake)".to_string(),
                    ),
                    Err(why) => (false, format!("userspace (rustls; no kernel TLS: {why})")),
                }
            };
        let config = build(&opts, ktls)?;
        Ok(Arc::new(Tls {
            opts,
            config: RwLock::new(config),
            record_layer,
            ktls,
        }))
    }

    /// Reads the credentials again: connections that start TLS from now on
    /// get the new ones; those running keep theirs. On error the old ones
    /// stay in force.
    pub fn reload(&self) -> Result<(), Error> {
        let c = build(&self.opts, self.ktls)?;
        match self.config.write() {
            Ok(mut g) => *g = c,
            Err(p) => *p.into_inner() = c,
        }
        Ok(())
    }

    /// The configuration a connection starting TLS now gets.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        match self.config.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// The options it was loaded with.
    pub fn options(&self) -> &TlsOptions {
        &self.opts
    }

    /// Whether connections hand their record layer to the kernel after the
    /// handshake.
    pub fn ktls(&self) -> bool {
        self.ktls
    }

    /// Where records are encrypted, and why (for logs and `udm serve`).
    pub fn record_layer(&self) -> &str {
        &self.record_layer
    }

    /// One line saying what the server asks of clients.
    pub fn describe(&self) -> String {
        let peer = if !self.opts.authz.is_empty() {
            format!(
                "client certificates required, subjects {}",
                self.opts.authz.join(" | ")
            )
        } else if self.opts.verify_peer {
            "client certificates required".into()
        } else {
            "no client certificates".into()
        };
        format!(
            "TLS {} with {} ({peer}); records in {}",
            self.opts.mode,
            self.opts.creds.display(),
            self.record_layer
        )
    }
}

/// ring's suites with AES-128-GCM first, chosen by the server's order:
/// clients (gnutls) prefer AES-256-GCM, which costs both sides more per
/// byte at a strength TLS 1.3 does not need.
fn provider() -> Arc<CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    let aes128 = [
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
        rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ];
    p.cipher_suites
        .sort_by_key(|s| !aes128.contains(&s.suite()));
    Arc::new(p)
}

fn pem_err(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!("--tls-creds: {}: {what}: {e}", path.display()))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    if !path.exists() {
        return Err(Error::invalid(format!(
            "--tls-creds: {}: no such file",
            path.display()
        )));
    }
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_err(path, "reading certificates", e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err(path, "reading certificates", e))?;
    if certs.is_empty() {
        return Err(Error::invalid(format!(
            "--tls-creds: {}: no certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

/// Builds the rustls configuration from the directory; `ktls`: sessions
/// give up their keys after the handshake, for the kernel.
fn build(opts: &TlsOptions, ktls: bool) -> Result<Arc<rustls::ServerConfig>, Error> {
    let dir = &opts.creds;
    if !dir.is_dir() {
        return Err(Error::invalid(format!(
            "--tls-creds '{}': not a directory (expected ca-cert.pem, server-cert.pem, \
             server-key.pem)",
            dir.display()
        )));
    }
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    let ca_path = dir.join("ca-cert.pem");
    let crl_path = dir.join("ca-crl.pem");
    let certs = read_certs(&cert_path)?;
    if !key_path.exists() {
        return Err(Error::invalid(format!(
            "--tls-creds: {}: no such file",
            key_path.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(&key_path)
        .map_err(|e| pem_err(&key_path, "reading the private key", e))?;
    let provider = provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| Error::invalid(format!("TLS: {e}")))?;
    let verify = opts.verify_peer || !opts.authz.is_empty();
    let builder = if verify {
        let mut roots = rustls::RootCertStore::empty();
        for c in read_certs(&ca_path)? {
            roots
                .add(c)
                .map_err(|e| pem_err(&ca_path, "a CA certificate", e))?;
        }
        let mut crls = Vec::new();
        if crl_path.exists() {
            crls = CertificateRevocationListDer::pem_file_iter(&crl_path)
                .map_err(|e| pem_err(&crl_path, "reading the CRL", e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| pem_err(&crl_path, "reading the CRL", e))?;
        }
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .with_crls(crls)
            .build()
            .map_err(|e| pem_err(&ca_path, "client verification", e))?;
        let v: Arc<dyn ClientCertVerifier> = if opts.authz.is_empty() {
            inner
        } else {
            Arc::new(Authz {
                inner,
                names: opts.authz.clone(),
            })
        };
        builder.with_client_cert_verifier(v)
    } else {
        builder.with_no_client_auth()
    };
    let mut cfg = builder
        .with_single_cert(certs, key)
        .map_err(|e| pem_err(&cert_path, "certificate and key", e))?;
    // No session tickets or resumption state kept: every connection does a
    // full handshake and is checked against the credentials in force.
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.send_tls13_tickets = 0;
    cfg.ignore_client_order = true;
    cfg.enable_secret_extraction = ktls;
    Ok(Arc::new(cfg))
}

/// The subject of a DER certificate in RFC 4514 form (the last RDN
/// first, `,` between RDNs, `+` within one), as gnutls and
/// `openssl -nameopt RFC2253` print it.
pub fn subject_name(der: &[u8]) -> Result<String, String> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("certificate: {e}"))?;
    let reg = x509_parser::objects::oid_registry();
    let mut rdns = Vec::new();
    for rdn in cert.subject().iter_rdn() {
        let mut parts = Vec::new();
        for a in rdn.iter() {
            let key = x509_parser::objects::oid2abbrev(a.attr_type(), reg)
                .map(str::to_string)
                .unwrap_or_else(|_| a.attr_type().to_id_string());
            let val = a
                .as_str()
                .map_err(|_| format!("subject attribute {key}: not a string"))?;
            parts.push(format!("{key}={}", escape_rfc4514(val)));
        }
        rdns.push(parts.join("+"));
    }
    rdns.reverse();
    Ok(rdns.join(","))
}

fn escape_rfc4514(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Checks a client certificate as the CA verifier does, then its subject
/// against the `--tls-authz` list. A refusal sends the client the
/// `access_denied` alert and is logged with the subject.
#[derive(Debug)]
struct Authz {
    inner: Arc<dyn ClientCertVerifier>,
    names: Vec<String>,
}

impl ClientCertVerifier for Authz {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let name = subject_name(end_entity).map_err(|e| {
            tracing::warn!("nbd: TLS client {e}");
            rustls::Error::InvalidCertificate(CertificateError::BadEncoding)
        })?;
        if self.names.contains(&name) {
            return Ok(ok);
        }
        tracing::warn!("nbd: TLS client certificate '{name}' is not in --tls-authz; refused");
        Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Whether this kernel has kernel TLS: sets the `tls` upper-layer protocol
/// on a connected loopback TCP socket (what kTLS offload needs first).
/// Err says why not (`ENOENT`: no `tls` module, CONFIG_TLS unset).
pub fn ktls_probe() -> Result<(), String> {
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("probe socket: {e}"))?;
    let addr = l.local_addr().map_err(|e| format!("probe socket: {e}"))?;
    let s = TcpStream::connect(addr).map_err(|e| format!("probe socket: {e}"))?;
    let name = b"tls";
    // SAFETY: setsockopt on a socket `s` keeps open, with a pointer to a
    // live byte string and its exact length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(format!(
            "setsockopt(TCP_ULP, \"tls\"): {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// Hands a connection's record layer to the kernel: the `tls` upper-layer
/// protocol on socket `fd`, then each direction's key, IV and next record
/// sequence number as the handshake left them. After an error the socket
/// is in no state to carry on (the keys have left rustls): close it.
pub fn ktls_install(
    fd: std::os::fd::RawFd,
    version: rustls::ProtocolVersion,
    secrets: rustls::ExtractedSecrets,
) -> Result<(), String> {
    let version = match version {
        rustls::ProtocolVersion::TLSv1_3 => libc::TLS_1_3_VERSION,
        rustls::ProtocolVersion::TLSv1_2 => libc::TLS_1_2_VERSION,
        v => return Err(format!("{v:?} has no kernel TLS")),
    };
    let name = b"tls";
    // SAFETY: setsockopt on the caller's open socket with a pointer to a
    // live byte string and its exact length.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_TCP,
            libc::TCP_ULP,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(format!(
            "setsockopt(TCP_ULP, \"tls\"): {}",
            std::io::Error::last_os_error()
        ));
    }
    let (tx_seq, tx) = &secrets.tx;
    let (rx_seq, rx) = &secrets.rx;
    set_crypto(fd, libc::TLS_TX, version, *tx_seq, tx).map_err(|e| format!("TLS_TX: {e}"))?;
    set_crypto(fd, libc::TLS_RX, version, *rx_seq, rx).map_err(|e| format!("TLS_RX: {e}"))
}

/// `dst` filled from `src`, which must be as long (lengths come from the
/// suite, and a mismatch is an error rather than a panic).
fn fill(dst: &mut [u8], src: &[u8], what: &str) -> Result<(), String> {
    if dst.len() != src.len() {
        return Err(format!(
            "{what}: {} bytes, the kernel takes {}",
            src.len(),
            dst.len()
        ));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// One direction's crypto_info, set on the socket and wiped from the stack.
fn set_crypto(
    fd: std::os::fd::RawFd,
    dir: libc::c_int,
    version: u16,
    seq: u64,
    s: &rustls::ConnectionTrafficSecrets,
) -> Result<(), String> {
    use rustls::ConnectionTrafficSecrets as S;
    /// Sets `info` (a tls12_crypto_info_* struct) and zeroes it.
    fn set<T>(fd: std::os::fd::RawFd, dir: libc::c_int, info: &mut T) -> Result<(), String> {
        // SAFETY: `info` is a live, initialised struct of the ABI type
        // the kernel reads for this cipher, with its exact size.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_TLS,
                dir,
                (info as *const T).cast(),
                std::mem::size_of::<T>() as libc::socklen_t,
            )
        };
        let err = std::io::Error::last_os_error();
        // SAFETY: `info` is plain bytes (arrays of u8 and u16s) owned by
        // the caller; volatile so that the wipe is not optimised away.
        unsafe { std::ptr::write_volatile(info as *mut T, std::mem::zeroed()) };
        if r == 0 {
            Ok(())
        } else {
            Err(err.to_string())
        }
    }
    let rec_seq = seq.to_be_bytes();
    // AES-GCM: the kernel takes the 12-byte IV as a 4-byte salt and the 8
    // bytes TLS 1.2 sends with each record.
    macro_rules! gcm {
        ($info:ty, $cipher:expr, $key:expr, $iv:expr) => {{
            // SAFETY: a C struct of byte arrays and u16s: all-zero is valid.
            let mut i: $info = unsafe { std::mem::zeroed() };
            i.info.version = version;
            i.info.cipher_type = $cipher;
            let iv = $iv.as_ref();
            fill(&mut i.salt, iv.get(..4).unwrap_or_default(), "salt")?;
            fill(&mut i.iv, iv.get(4..).unwrap_or_default(), "iv")?;
            fill(&mut i.key, $key.as_ref(), "key")?;
            i.rec_seq = rec_seq;
            set(fd, dir, &mut i)
        }};
    }
    match s {
        S::Aes128Gcm { key, iv } => gcm!(
            libc::tls12_crypto_info_aes_gcm_128,
            libc::TLS_CIPHER_AES_GCM_128,
            key,
            iv
        ),
        S::Aes256Gcm { key, iv } => gcm!(
            libc::tls12_crypto_info_aes_gcm_256,
            libc::TLS_CIPHER_AES_GCM_256,
            key,
            iv
        ),
        S::Chacha20Poly1305 { key, iv } => {
            // SAFETY: as in gcm!.
            let mut i: libc::tls12_crypto_info_chacha20_poly1305 = unsafe { std::mem::zeroed() };
            i.info.version = version;
            i.info.cipher_type = libc::TLS_CIPHER_CHACHA20_POLY1305;
            fill(&mut i.iv, iv.as_ref(), "iv")?;
            fill(&mut i.key, key.as_ref(), "key")?;
            i.rec_seq = rec_seq;
            set(fd, dir, &mut i)
        }
        _ => Err("a cipher kernel TLS lacks".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4514_escapes_specials() {
        assert_eq!(escape_rfc4514("a,b"), "a\\,b");
        assert_eq!(escape_rfc4514(" x "), "\\ x\\ ");
        assert_eq!(escape_rfc4514("#1"), "\\#1");
        assert_eq!(escape_rfc4514("plain"), "plain");
    }

    #[test]
    fn a_missing_directory_is_named() {
        let e = Tls::load(TlsOptions {
            mode: TlsMode::Require,
            creds: "/nonexistent/creds".into(),
            ..TlsOptions::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("/nonexistent/creds': not a directory"), "{e}");
    }
}
