"""Mutual TLS on the worker links: who may register as a worker, and as which one.

Both ends show a certificate signed by the cluster's CA (--tls-ca) and check
the other's: the worker checks that the router's certificate is valid for the
name it dialled (its --connect host), the router that the worker's was issued
by the CA, is in date, and names the worker id the connection then registers.
A worker's certificate names its id in the subject's common name: exactly
(`w1`: only worker id w1 may register with it, or take w1 over), or as a
family when the name ends in `*` (`fencepost-worker-*`: any id that starts
with `fencepost-worker-`, which is how the pods of one Deployment, named after
it, share one certificate). The handshake is TLS 1.3: fresh keys per
connection, so bytes captured from one connection are useless on another.

The router sends nothing before a connection has passed the handshake and
registered under an id its certificate allows, so an impostor never sees a
prompt. See docs/design/runtime.md for why mutual TLS is the default for
deployments.

Certificates are renewed while processes run (cert-manager replaces a
Secret's files well before they expire), so each side holds its files as
Credentials: before a handshake, at most every few seconds, the three files
are looked at (size, time, inode: a Secret is swapped by a symbolic link) and
read again when one changed. New connections then use the new ones; a session
already open keeps the keys it agreed. Files caught half-written, or otherwise
unusable, are said in the log once and the ones loaded before stay in use.

Certificates of these shapes are made here too (make_certificates: a CA, the
routers' certificate valid for their names, and one per worker id or family;
EC P-256 keys), for `fencepost certs`, `fencepost cluster --tls`, the benches
and the tests; an operator with a PKI issues the same shapes from it.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("fencepost.tls")


class TlsError(ValueError):
    """TLS files that cannot be used (missing, unreadable, key and certificate apart)."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path


def _load(context: ssl.SSLContext, files: TlsFiles) -> ssl.SSLContext:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    for path in (files.cert, files.key, files.ca):
        if not path.is_file():
            raise TlsError(f"TLS file {path} does not exist")
    try:
        context.load_verify_locations(cafile=str(files.ca))
    except ssl.SSLError as error:
        raise TlsError(f"{files.ca} is not a PEM CA certificate: {error}") from None
    try:
        context.load_cert_chain(str(files.cert), str(files.key))
    except ssl.SSLError as error:
        raise TlsError(
            f"{files.cert} with {files.key}: not a PEM certificate and its key ({error})"
        ) from None
    return context


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The router's: it shows its certificate and requires one from the worker."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_REQUIRED
    return _load(context, files)


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The worker's: it checks the router's certificate and name, and shows its own."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # hostname checked, certificate required
    return _load(context, files)


def valid_until(cert: Path) -> str:
    """The certificate's last valid moment, for the log."""
    from cryptography import x509

    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return "unknown"
    return loaded.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")


class Credentials:
    """A TLS context that follows its files (see above). `make` is server_context
    or client_context; unusable files at the start raise TlsError."""

    CHECK_S = 5.0  # how often the files are looked at, at most

    def __init__(
        self,
        files: TlsFiles,
        make: Callable[[TlsFiles], ssl.SSLContext],
        check_s: float = CHECK_S,
    ) -> None:
        self.files = files
        self._make = make
        self._check_s = check_s
        self._stamp = self._stamps()
        self._context = make(files)
        self._checked = time.monotonic()
        self.reloads = 0
        log.info("TLS: %s, valid until %s", files.cert, valid_until(files.cert))

    def _stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in (self.files.cert, self.files.key, self.files.ca):
            try:
                found = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((found.st_mtime_ns, found.st_size, found.st_ino))
        return tuple(stamps)

    def context(self) -> ssl.SSLContext:
        """The context for a new connection: the files' current contents, if usable."""
        now = time.monotonic()
        if now - self._checked < self._check_s:
            return self._context
        self._checked = now
        stamp = self._stamps()
        if stamp == self._stamp:
            return self._context
        self._stamp = stamp  # a change is tried once; the next change is tried again
        try:
            self._context = self._make(self.files)
        except TlsError as error:
            log.warning("TLS files changed but cannot be used (%s); the earlier ones stay", error)
        else:
            self.reloads += 1
            log.info(
                "TLS files changed: %s reloaded, valid until %s",
                self.files.cert,
                valid_until(self.files.cert),
            )
        return self._context


def peer_name(stream: trio.SSLStream[trio.SocketStream]) -> str | None:
    """The common name of the peer's (verified) certificate."""
    cert = stream.getpeercert()
    if not cert:
        return None
    for entry in cert.get("subject", ()):
        for key, value in entry:
            if key == "commonName":
                return str(value)
    return None


def allows(name: str | None, worker_id: str) -> bool:
    """Whether a certificate named `name` may register as `worker_id` (see above)."""
    if not name:
        return False
    if name.endswith("*"):
        prefix = name[:-1]
        return len(worker_id) > len(prefix) and worker_id.startswith(prefix)
    return worker_id == name


def failure(error: BaseException) -> str:
    """What a failed handshake says, from the SSL error under trio's BrokenResourceError."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate refused: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):
        if cause.reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL"):
            return f"the peer does not speak TLS ({cause.reason})"
        return cause.reason or str(cause)
    return str(error) or type(error).__name__


# --- making certificates ---


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(out: Path, stem: str, cert: Any, key: Any | None) -> list[Path]:
    from cryptography.hazmat.primitives import serialization

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.crt"]
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        paths.append(out / f"{stem}.key")
        paths[1].touch(mode=0o600)
        paths[1].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths


def certificate(
    name: str,
    key: Any,
    issuer: tuple[Any, Any] | None,
    *,
    days: int = 365,
    sans: list[str] | None = None,
    client: bool = False,
    not_before: datetime.datetime | None = None,
) -> Any:
    """One certificate for `name` (common name), signed by issuer (its certificate
    and key), or self-signed as a CA when issuer is None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    signer_cert, signer_key = issuer if issuer is not None else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if signer_cert is None else signer_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)
    else:
        purpose = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    if sans:
        entries: list[x509.GeneralName] = []
        for san in sans:
            try:
                entries.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                entries.append(x509.DNSName(san))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    return builder.sign(signer_key, hashes.SHA256())


def load_ca(folder: Path) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    return cert, key


def make_certificates(
    out: Path, router_names: list[str], workers: list[str], days: int, ca: Path | None = None
) -> list[Path]:
    """Write the CA (unless `ca` names one), the routers' and the workers' files."""
    written: list[Path] = []
    if ca is None:
        ca_key = _key()
        ca_cert = certificate("fencepost CA", ca_key, None, days=days)
        written += _write(out, "ca", ca_cert, ca_key)
    else:
        ca_cert, ca_key = load_ca(ca)
        written += _write(out, "ca", ca_cert, None)
    issuer = (ca_cert, ca_key)
    router_key = _key()
    router = certificate("fencepost-router", router_key, issuer, days=days, sans=router_names)
    written += _write(out, "router", router, router_key)
    for worker_id in workers:
        key = _key()
        cert = certificate(worker_id, key, issuer, days=days, client=True)
        written += _write(out, worker_id.replace("*", "family"), cert, key)
    return written
