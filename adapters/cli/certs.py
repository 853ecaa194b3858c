"""`fencepost certs`: a CA and certificates for the worker links of a cluster.

Writes into --out: ca.crt and ca.key (the CA: keep ca.key off the cluster),
router.crt and router.key (valid for every --router-name: the names and
addresses workers --connect to), and for each --worker ID, ID.crt and ID.key
(the id in the subject's common name; an ID ending in `*` names a family of
ids). The certificates are made by adapters/runtime/tls.py, which also checks
them on the links. Keys are EC P-256, certificates valid for --days. Each
certificate file also works as cert-manager's `tls.crt` and the CA as its
`ca.crt`. For a test cluster or a first deployment; an operator with a PKI
issues the same shapes from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adapters.runtime.tls import make_certificates

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
