"""Signing a pack with OpenSSF model signing (the `model-signing` package), and checking a signature.

A signed pack holds `model.sig`: a Sigstore bundle (DSSE envelope) whose in-toto statement lists
every other file of the folder with its SHA-256, signed by an elliptic-curve private key (P-256,
P-384 or P-521, PEM). Third-party tools check it as they check a signed model folder:

    model_signing verify key --signature PACK/model.sig --public_key KEY.pub PACK

No network is used: the key signer and verifier need no Sigstore service.

`signed_files` checks the bundle's signature against a trusted public key and returns what it
signed (file -> SHA-256) without reading the files: the importer then hashes each file once, from
the very bytes it imports, and compares.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

from kvstore.errors import PackError
from kvstore.packs.manifest import SIGNATURE

MAX_SIGNATURE_BYTES = 1 << 20
_CURVES = ("secp256r1", "secp384r1", "secp521r1")


def sign(folder: Path, private_key: Path) -> None:
    """Write `folder/model.sig`, signing every other file of `folder` with `private_key`."""
    from model_signing import hashing, signing

    config = hashing.Config().set_ignored_paths(paths=[SIGNATURE])
    try:
        signer = signing.Config().use_elliptic_key_signer(private_key=Path(private_key))
    except (ValueError, TypeError, OSError) as e:
        raise PackError(f"--sign-key {private_key}: not an elliptic-curve private key in PEM "
                        f"(P-256, P-384 or P-521) that can be read ({_one_line(e)})") from None
    signer.set_hashing_config(config).sign(folder, folder / SIGNATURE)


def check_private_key(private_key: Path) -> None:
    """PackError unless `private_key` is an elliptic-curve private key the signer takes (read
    before anything is computed, so a bad key fails at once)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = _key_file(private_key, "--sign-key")
    try:
        key = serialization.load_pem_private_key(data, None)
        why = _unfit(key, ec.EllipticCurvePrivateKey)
    except (ValueError, TypeError, OSError) as e:
        why = _one_line(e)
    if why:
        raise PackError(f"--sign-key {private_key}: not an unencrypted elliptic-curve private key in PEM "
                        f"(P-256, P-384 or P-521) that can be read ({why})")


def check_public_key(public_key: Path) -> None:
    """PackError unless `public_key` is an elliptic-curve public key the verifier takes (read
    before the model is loaded, so a mistyped key fails at once)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = _key_file(public_key, "--trust-key")
    try:
        key = serialization.load_pem_public_key(data)
        why = _unfit(key, ec.EllipticCurvePublicKey)
    except (ValueError, TypeError, OSError) as e:
        why = _one_line(e)
    if why:
        raise PackError(f"--trust-key {public_key}: not an elliptic-curve public key in PEM (P-256, P-384 or "
                        f"P-521) that can be read ({why})")


def signed_files(folder: Path, public_key: Path) -> dict[str, str]:
    """What `folder/model.sig` signs (file -> SHA-256), once its signature is checked against
    `public_key`. PackError (one line) if there is no signature, it is not valid, or not by that key."""
    # model_signing's public verifier (`verifying.Config().use_elliptic_key_verifier().verify`)
    # hashes the files on disk itself and returns nothing: the importer would read and hash every
    # blob twice, and what it checked would not be the bytes it stores. Its key verifier and
    # bundle reader, which give the signed manifest, are only in `_signing` (the version is pinned,
    # >=1.1,<2, in pyproject.toml; tests/test_packs.py runs the public verifier on a pack too).
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    check_public_key(public_key)  # its type first: the verifier takes any PEM key and fails on the first it cannot use
    try:
        verifier = sign_ec_key.Verifier(Path(public_key))
    except (ValueError, TypeError, OSError, AttributeError) as e:
        raise PackError(f"--trust-key {public_key}: not an elliptic-curve public key in PEM (P-256, P-384 or "
                        f"P-521) that can be read ({_one_line(e)})") from None
    path = folder / SIGNATURE
    _check_signature_file(path)
    try:
        signature = sign_sigstore_pb.Signature.read(path)
    except Exception as e:  # not JSON, not a Sigstore bundle: no signature to verify at all
        why = f"it has no field {e.args[0]!r}" if isinstance(e, KeyError) and e.args else _one_line(e)
        raise PackError(f"{path} is not a signature that can be read (a Sigstore bundle, as kvstore pack export "
                        f"and model_signing write it): {why}") from None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a warning for old bundles
            manifest = verifier.verify(signature)
    except Exception as e:  # a bad signature, another key, a damaged bundle: all one answer
        raise PackError(f"the pack's signature does not verify with the trusted key {public_key} "
                        f"({_one_line(e)})") from None
    method = manifest.serialization_type
    if method.get("method") != "files" or method.get("hash_type") != "sha256":
        raise PackError(f"the pack's signature hashes files by {method.get('method')}/{method.get('hash_type')}, "
                        "not files/sha256: sign it with kvstore pack export or model_signing's defaults")
    out = {}
    for rd in manifest.resource_descriptors():
        if rd.digest.algorithm != "sha256":
            raise PackError(f"the pack's signature hashes {rd.identifier} with {rd.digest.algorithm}, not sha256")
        out[str(rd.identifier)] = rd.digest.digest_hex
    return out


def _check_signature_file(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise PackError(f"the pack is not signed (no {SIGNATURE}), and --trust-key requires a signature "
                        "by that key: import it without --trust-key only if you trust where it came from") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SIGNATURE_BYTES:
        raise PackError(f"{path} is not a signature file (a regular file of at most {MAX_SIGNATURE_BYTES} bytes)")


def _unfit(key, kind: type) -> str:
    """Why `key` is not one the signer or verifier takes ("" when it is): its type, or its curve."""
    if not isinstance(key, kind):
        return _a(type(key).__name__.lstrip('_'))
    return "" if key.curve.name in _CURVES else f"an elliptic-curve key on the curve {key.curve.name}"


def _key_file(path: Path, option: str) -> bytes:
    """The bytes of a key file; PackError naming the option where there is no such file to read."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise PackError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise PackError(f"{option} {path}: a folder, not a key file") from None
    except OSError as e:
        raise PackError(f"{option} {path}: cannot be read ({e.strerror or e})") from None


def _a(name: str) -> str:
    """`an Ed25519PublicKey`, `a RSAPublicKey`: a key type's name with its article."""
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]
