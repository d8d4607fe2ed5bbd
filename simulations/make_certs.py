"""Test certificates and SuperNode keys for a FedLookahead deployment (no openssl needed).

    python simulations/make_certs.py --out certs --nodes 3 [--san 192.168.1.10 --san myserver.lan]

writes into --out:

    ca.crt / ca.key            a local certificate authority (ECDSA P-384, self-signed)
    server.pem / server.key    the SuperLink's TLS certificate, signed by the CA, with SANs
                               localhost, 127.0.0.1, ::1 and every --san
    node-<i>, node-<i>.pub     one SuperNode key pair per device, ECDSA P-384 in OpenSSH format
                               (what `flower-supernode --auth-supernode-private-key` and
                               `flwr supernode register` read; Flower's node auth needs a NIST EC curve)

The SuperLink gets ca.crt, server.pem and server.key; every device gets ca.crt (to check the
SuperLink) and its own node-<i> private key; the server operator registers each node-<i>.pub.
For real deployments use your organisation's CA; these files are for tests and trials.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CURVE = ec.SECP384R1


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(out: Path, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(CURVE())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedLookahead test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    _write(out / "ca.key", _key_pem(key), private=True)
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_server_cert(
    out: Path, ca_key, ca_cert: x509.Certificate, names: list[str], days: int, stem: str = "server"
) -> None:
    key = ec.generate_private_key(CURVE())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(out / f"{stem}.key", _key_pem(key), private=True)
    _write(out / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM))


def make_node_key(out: Path, name: str) -> Path:
    """An ECDSA P-384 key pair in OpenSSH format: <name> (private) and <name>.pub."""
    key = ec.generate_private_key(CURVE())
    _write(
        out / name,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
        private=True,
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(out / f"{name}.pub", public + f" fedla-{name}\n".encode())
    return out / name


def make_certs(out: Path, nodes: int = 3, sans: list[str] | None = None, days: int = 365) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(out, days)
    names = ["localhost", "127.0.0.1", "::1", *(sans or [])]
    make_server_cert(out, ca_key, ca_cert, list(dict.fromkeys(names)), days)
    for index in range(1, nodes + 1):
        make_node_key(out, f"node-{index}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("certs"), help="output folder (default: certs)")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs to create (default: 3)")
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        help="extra host name or IP of the SuperLink for its certificate (repeatable)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    args = parser.parse_args()
    out = make_certs(args.out, args.nodes, args.san, args.days)
    print(f"wrote CA, server certificate and {args.nodes} node key pair(s) to {out.resolve()}")


if __name__ == "__main__":
    main()
