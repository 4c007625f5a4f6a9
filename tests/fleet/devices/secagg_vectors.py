"""SecAgg+'s golden vectors (``tests/web/secagg_vectors.json``), made by Flower's own Python functions.

The JavaScript SecAgg+ client (``ort_lightning/fleet/devices/web/secagg*.js``) must match Flower
byte for byte; ``tests/web/secagg.test.mjs`` checks it against these vectors, and
``test_secagg_vectors.py`` checks that Flower still writes them. Flower's randomness is pinned
where it draws: ``os.urandom`` (Fernet's IV, the mask seed), ``time.time`` (Fernet's timestamp),
PyCryptodome's ``get_random_bytes`` (Shamir's coefficients, drawn one chunk after another on one
worker) and numpy's global state (the stochastic rounding). ``python -m
tests.fleet.devices.secagg_vectors`` rewrites the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import flwr
import numpy as np
from Crypto.Protocol import SecretSharing
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.client.mod.secure_aggregation.secaggplus_mod import (
    SecAggPlusState,
    _collect_masked_vectors,
    _share_keys,
    _unmask,
)
from flwr.common import ConfigRecord
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_multiply
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.compat.common.parameter import ndarray_to_bytes, ndarrays_to_parameters
from flwr.supercore.primitives.asymmetric import private_key_to_bytes, public_key_to_bytes

from tests.helpers import ROOT

PATH = ROOT / "tests" / "web" / "secagg_vectors.json"
FLOWER = "1.42.0"
TIME = 1_767_225_600  # Fernet's timestamp in the pinned tokens (2026-01-01T00:00:00Z)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Stream:
    """Deterministic bytes (SHA-256 of a label and a counter), recorded in the order they were drawn."""

    def __init__(self, label: str) -> None:
        self._label, self._count, self.drawn = label, 0, bytearray()

    def __call__(self, size: int) -> bytes:
        out = b""
        while len(out) < size:
            out += hashlib.sha256(f"{self._label}:{self._count}".encode()).digest()
            self._count += 1
        self.drawn += out[:size]
        return out[:size]


@contextmanager
def pinned(stream: Callable[[int], bytes]) -> Iterator[None]:
    """Flower's randomness from ``stream`` and its clock at ``TIME``, Shamir's chunks on one worker in order."""
    with mock.patch.object(os, "urandom", stream), mock.patch.object(SecretSharing, "rng", stream), \
            mock.patch("time.time", return_value=TIME + 0.5), mock.patch.object(os, "cpu_count", return_value=1):
        yield


def private_key(seed: int) -> ec.EllipticCurvePrivateKey:
    """A fixed P-384 key (its scalar from a SHA-384 of the seed)."""
    scalar = int.from_bytes(hashlib.sha384(f"secagg key {seed}".encode()).digest(), "big")
    return ec.derive_private_key(scalar % (2**383), ec.SECP384R1())


def _keys() -> dict[str, Any]:
    a, b = private_key(1), private_key(2)
    shared = generate_shared_key(a, b.public_key())
    assert shared == generate_shared_key(b, a.public_key())
    return {"a_private": private_key_to_bytes(a).decode(), "a_public": public_key_to_bytes(a.public_key()).decode(),
            "b_private": private_key_to_bytes(b).decode(), "b_public": public_key_to_bytes(b.public_key()).decode(),
            "shared_key": shared.decode()}


def _fernet(key: bytes) -> list[dict[str, Any]]:
    out = []
    for plaintext in (b"", b"sixteen bytes!!!", bytes(range(200)),
                      share_keys_plaintext_concat(7, 2**64 - 1, bytes(range(52)), bytes(i % 256 for i in range(260)))):
        stream = Stream(f"fernet {len(plaintext)}")
        with pinned(stream):
            token = encrypt(key, plaintext)
        assert decrypt(key, token) == plaintext
        out.append({"plaintext": _b64(plaintext), "iv": _b64(bytes(stream.drawn)), "time": TIME,
                    "token": token.decode()})
    return out


def _masks() -> list[dict[str, Any]]:
    seeds = [bytes(range(32)), b"\xff\xff\xff\xff", _keys()["shared_key"].encode(), bytes(4)]
    cases = [(2**32, [[1000]]), (2**32, [[3, 4], [], [1]]), (2**16, [[500]]), (1000, [[300]]),
             (2**32 + 1, [[50]]), (3, [[40]])]
    out = []
    for seed in seeds:
        for num_range, shapes in cases:
            masks = pseudo_rand_gen(seed, num_range, [tuple(s) for s in shapes])
            out.append({"seed": _b64(seed), "num_range": num_range, "shapes": shapes,
                        "masks": [m.flatten().tolist() for m in masks]})
    return out


def _shamir() -> list[dict[str, Any]]:
    out = []
    for secret, threshold, count, subset in ((bytes(range(32)), 3, 5, [4, 1, 2]),
                                             (private_key_to_bytes(private_key(3)), 2, 3, [3, 2]),
                                             (b"short", 1, 2, [2]), (bytes(range(16)), 4, 4, [1, 2, 3, 4])):
        stream = Stream(f"shamir {threshold} {count}")
        with pinned(stream):
            shares = create_shares(secret, threshold, count)
        assert combine_shares([shares[i - 1] for i in subset]) == secret
        out.append({"secret": _b64(secret), "threshold": threshold, "count": count,
                    "random": _b64(bytes(stream.drawn)), "shares": [_b64(s) for s in shares], "subset": subset})
    return out


def _quantization() -> list[dict[str, Any]]:
    out = []
    for dtype, seed, clipping, target in (("float32", 0, 8.0, 2**22), ("float64", 1, 8.0, 2**22),
                                          ("float32", 2, 3.0, 2**16), ("float32", 3, 0.5, 1000)):
        rng = np.random.default_rng(seed)
        arrays = [rng.normal(0, 4, size=200).astype(dtype), (rng.normal(0, 4, size=(2, 3))).astype(dtype),
                  np.array(rng.normal(), dtype=dtype)]
        np.random.seed(seed)
        quantized = quantize(arrays, clipping, target)
        dequantized = dequantize(quantized, clipping, target)
        out.append({"dtype": dtype, "seed": seed, "clipping_range": clipping, "target_range": target,
                    "shapes": [list(a.shape) for a in arrays], "arrays": [a.flatten().tolist() for a in arrays],
                    "quantized": [q.flatten().tolist() for q in quantized],
                    "dequantized": [d.flatten().tolist() for d in dequantized]})
    return out


def _weighting() -> dict[str, Any]:
    """The update times the weight's factor (``_collect_masked_vectors``), in float32 as numpy keeps it."""
    values = np.random.default_rng(4).normal(0, 1, size=1000).astype(np.float32)
    factor = round(37 / 74.0 * 997) / 997
    (product,) = parameters_multiply([values], factor)
    assert product.dtype == np.float32
    return {"values": values.tolist(), "factor": factor, "product": product.tolist()}


def _plaintexts() -> list[dict[str, Any]]:
    out = []
    for src, dst, b_share, sk_share in ((1, 2, b"b", b"sk"), (2**64 - 1, 12345678901234567, bytes(52), bytes(260)),
                                        (0, 0, b"", b"")):
        plaintext = share_keys_plaintext_concat(src, dst, b_share, sk_share)
        assert share_keys_plaintext_separate(plaintext) == (src, dst, b_share, sk_share)
        out.append({"src": str(src), "dst": str(dst), "b_share": _b64(b_share), "sk_share": _b64(sk_share),
                    "plaintext": _b64(plaintext)})
    return out


def _npy() -> list[dict[str, Any]]:
    arrays = [np.arange(5, dtype=np.int64) * 2**31, np.array([[0, 1, 2], [2**32 - 1, 7, 8]], dtype=np.int64),
              np.array(42, dtype=np.int64), np.zeros(0, dtype=np.int64), np.arange(10**4, dtype=np.int64)[:1]]
    return [{"shape": list(a.shape), "values": a.flatten().tolist(), "npy": _b64(ndarray_to_bytes(a))}
            for a in arrays]


# Flower's defaults, then ranges that are not powers of two (the weight's factor inexact in float32, masks mod 1000).
ROUNDS = [{"sample_num": 3, "share_num": 3, "threshold": 2, "clipping_range": 8.0, "target_range": 2**22,
           "mod_range": 2**32, "max_weight": 1000.0},
          {"sample_num": 3, "share_num": 3, "threshold": 2, "clipping_range": 1.5, "target_range": 997,
           "mod_range": 100_003, "max_weight": 74.0}]  # 37 / 74 * 997 = 498.5: Python's round gives 498
NODES = [2**64 - 3, 2**40 + 5, 3]  # the share-keys record's order; the device under test is the second


def _pem_pair(seed: int) -> tuple[bytes, bytes]:
    key = private_key(seed)
    return private_key_to_bytes(key), public_key_to_bytes(key.public_key())


def _state(nid: int, round_: dict[str, Any]) -> SecAggPlusState:
    """Flower's mod state after its setup stage, with fixed keys in place of new ones."""
    state = SecAggPlusState()
    (state.sk1, state.pk1), (state.sk2, state.pk2) = _pem_pair(10 + nid % 97), _pem_pair(20 + nid % 97)
    for key, value in {**round_, "nid": nid, "rd_seed_share_dict": {}, "sk1_share_dict": {}, "ss2_dict": {},
                       "public_keys_dict": {}}.items():
        setattr(state, key, value)
    return state


def _stages(round_: dict[str, Any]) -> dict[str, Any]:
    """One device's share-keys, collect and unmask replies, by Flower's own stage functions."""
    states = {nid: _state(nid, round_) for nid in NODES}
    me = states[NODES[1]]
    keys = ConfigRecord({str(nid): [s.pk1, s.pk2] for nid, s in states.items()})
    stream = Stream("share keys")
    with pinned(stream):
        shared_keys = _share_keys(me, keys)
    with pinned(Stream("the other nodes")):
        sent = {nid: _share_keys(states[nid], keys) for nid in (NODES[0], NODES[2])}
    srcs = [NODES[2], NODES[0]]
    ctxts = [sent[nid]["ctxts"][sent[nid]["dsts"].index(me.nid)] for nid in srcs]
    rng = np.random.default_rng(5)
    arrays = [rng.normal(0, 0.5, size=40).astype(np.float32), rng.normal(0, 0.5, size=(2, 3)).astype(np.float32)]
    np.random.seed(7)
    collected = _collect_masked_vectors(me, ConfigRecord({"ctxts": ctxts, "srcs": srcs}), 37,
                                        ndarrays_to_parameters(arrays))
    unmasked = _unmask(me, ConfigRecord({"active_nids": [NODES[1], NODES[2]], "dead_nids": [NODES[0]]}))
    return {"round": round_, "nodes": [str(n) for n in NODES], "sk1": me.sk1.decode(), "sk2": me.sk2.decode(),
            "public_keys": [[str(n), s.pk1.decode(), s.pk2.decode()] for n, s in states.items()],
            "random": _b64(bytes(stream.drawn)), "time": TIME,
            "share_keys": {"dsts": [str(d) for d in shared_keys["dsts"]],
                           "ctxts": [c.decode() for c in shared_keys["ctxts"]]},
            "collect": {"srcs": [str(s) for s in srcs], "ctxts": [c.decode() for c in ctxts], "num_examples": 37,
                        "seed": 7, "shapes": [list(a.shape) for a in arrays],
                        "arrays": [a.flatten().tolist() for a in arrays],
                        "masked_params": [_b64(b) for b in collected["masked_params"]]},
            "unmask": {"active_nids": [str(NODES[1]), str(NODES[2])], "dead_nids": [str(NODES[0])],
                       "nids": [str(n) for n in unmasked["nids"]], "shares": [_b64(b) for b in unmasked["shares"]]}}


def vectors() -> dict[str, Any]:
    """Every vector, as Flower writes it today (numpy's global random state left as it was)."""
    saved = np.random.get_state()
    try:
        return _all()
    finally:
        np.random.set_state(saved)


def _all() -> dict[str, Any]:
    keys = _keys()
    return {"flwr": flwr.__version__, "keys": keys, "fernet": _fernet(keys["shared_key"].encode()),
            "masks": _masks(), "shamir": _shamir(), "quantization": _quantization(), "weighting": _weighting(),
            "plaintexts": _plaintexts(), "npy": _npy(), "stages": [_stages(r) for r in ROUNDS]}


if __name__ == "__main__":
    if flwr.__version__ != FLOWER:
        raise SystemExit(f"the vectors are pinned to flwr {FLOWER}, but flwr {flwr.__version__} is installed; "
                         f"install flwr=={FLOWER} to rewrite them, or move the pin after checking the JavaScript")
    PATH.write_text(json.dumps(vectors(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {PATH.relative_to(ROOT)}")
