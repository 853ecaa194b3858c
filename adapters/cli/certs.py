"""`fencepost certs`: a CA and certificates for the worker links of a cluster.

Writes into --out: ca.crt and ca.key (the CA: keep ca.key off the cluster),
router.crt and router.key (valid for every --router-name: the names and
addresses workers --connect to), and for each --worker ID, ID.crt and ID.key
(the id in the subject's common name; an ID ending in `*` names a family of
ids, see adapters/runtime/tls.py). Keys are EC P-256, certificates valid for
--days. Each certificate file also works as cert-manager's `tls.crt` and the
CA as its `ca.crt`. For a test cluster or a first deployment; an operator with
a PKI issues the same shapes from it.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from pathlib import Path
from typing import Any

ROUTER_NAMES = ("localhost", "127.0.0.1", "fencepost-router-workers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument(
        "--router-name", action="append", default=None, metavar="NAME",
        help="a DNS name or IP address the routers' certificate is valid for; repeat "
        f"(default: {', '.join(ROUTER_NAMES)})",
    )  # fmt: skip
    parser.add_argument(
        "--worker", action="append", default=[], metavar="ID",
        help="a worker id to certify (repeat); 'name-*' certifies every id starting 'name-'",
    )  # fmt: skip
    parser.add_argument("--days", type=int, default=365, help="validity (default %(default)s)")
    parser.add_argument(
        "--ca", type=Path, default=None, metavar="DIR",
        help="sign with the CA already in DIR (ca.crt, ca.key) instead of making one",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    names = args.router_name or list(ROUTER_NAMES)
    written = make_certificates(args.out, names, args.worker, args.days, args.ca)
    for path in written:
        print(path)
    return 0


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
