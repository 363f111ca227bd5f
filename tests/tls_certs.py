"""Throwaway certificates for tests (the openssl CLI): a CA, and certificates it signs."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str = "ca") -> tuple[Path, Path]:
    """(certificate, key) of a new self-signed CA in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=kdn-test-{name}",
             "-keyout", str(key), "-out", str(cert))
    return cert, key


def issue(ca: tuple[Path, Path], d: Path, name: str, *, cn: str, server: bool,
          ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """(certificate, key) signed by ``ca``: a server one for ``ip``/localhost, or a client one for ``cn``."""
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.cnf"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(key), "-out", str(csr))
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    san = f"subjectAltName=IP:{ip},DNS:localhost\n" if server else ""
    ext.write_text(f"{san}basicConstraints=CA:FALSE\nextendedKeyUsage={usage}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return cert, key


def make_ca_and_cert(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key)."""
    ca = make_ca(d)
    cert, key = issue(ca, d, "srv", cn="127.0.0.1", server=True)
    return ca[0], cert, key
