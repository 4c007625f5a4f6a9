"""Flower reads what the JavaScript SecAgg+ client makes with its own randomness (``tests/web/secagg_interop.mjs``).

The other direction, the JavaScript reading what Flower makes, is in ``tests/web/secagg.test.mjs``.
Here Node makes a fresh key pair, a Fernet token, Shamir shares and masks with WebCrypto's
randomness, and Flower's own functions load the keys, derive the same shared key, decrypt the
token, combine the shares at the threshold and draw the same masks.
"""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.common.secure_aggregation.crypto.shamir import combine_shares  # noqa: E402
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, generate_shared_key  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen  # noqa: E402
from flwr.supercore.primitives.asymmetric import (  # noqa: E402
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)

from tests._web import ROOT, run_node  # noqa: E402
from tests.fleet.devices.secagg_vectors import PATH  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("node") is None, reason="node (Node.js 20) is not installed: "
                                 "the JavaScript SecAgg+ client runs in Node here (.ci/run installs it)")]


@pytest.fixture(scope="module")
def made() -> dict:
    return json.loads(run_node(ROOT / "tests" / "web" / "secagg_interop.mjs", timeout=60))


def test_flower_loads_the_javascript_keys_and_derives_the_same_shared_key(made: dict) -> None:
    keys = json.loads(PATH.read_text(encoding="utf-8"))["keys"]
    private = bytes_to_private_key(made["private_key"].encode())
    assert public_key_to_bytes(private.public_key()) == made["public_key"].encode()
    python_private = bytes_to_private_key(keys["b_private"].encode())
    shared = generate_shared_key(python_private, bytes_to_public_key(made["public_key"].encode()))
    assert shared == made["shared_key"].encode()


def test_flower_decrypts_the_javascript_token(made: dict) -> None:
    plaintext = decrypt(made["shared_key"].encode(), made["token"].encode())
    assert plaintext == base64.b64decode(made["plaintext"])


@pytest.mark.parametrize("subset", [[1, 2, 3], [5, 3, 1], [2, 4, 5]], ids=["first", "shuffled", "last"])
def test_flower_combines_the_javascript_shares_at_the_threshold(made: dict, subset: list[int]) -> None:
    shares = [base64.b64decode(made["shares"][i - 1]) for i in subset]
    assert combine_shares(shares) == base64.b64decode(made["secret"])
    try:  # below the threshold: garbage, which unpads (and then differs) once in 256 draws
        below = combine_shares(shares[:2])
    except ValueError:
        below = None
    assert below != base64.b64decode(made["secret"])


def test_flower_rebuilds_the_javascript_private_key_from_its_shares(made: dict) -> None:
    # The server's unmask stage: a dropped device's first private key, from its shares, loaded by Flower.
    pem = combine_shares([base64.b64decode(s) for s in made["key_shares"][1:]])
    assert pem == made["private_key"].encode()
    assert public_key_to_bytes(bytes_to_private_key(pem).public_key()) == made["public_key"].encode()


def test_flower_draws_the_javascript_masks(made: dict) -> None:
    (masks,) = pseudo_rand_gen(made["shared_key"].encode(), 2**32, [(100,)])
    np.testing.assert_array_equal(masks, np.array(made["masks"], dtype=np.int64))
