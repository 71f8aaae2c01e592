"""Packed sequences equal padded ones: log-probs, entropy, loss, per-sequence values and gradients
at TP1, TP2, PP2 and CP2 (x DP2), from the one ``torchrun`` launch of the parallel policy tests
(``parallel_run``: every other case of that launch packs, and is compared with transformers and with
the single-rank run in test_policy_parallel.py / test_context_parallel.py).

Tolerances (fp32, the two layouts sum in different orders): log-probs and entropy 3e-6 absolute;
summed loss 1e-6; gradients 1e-5 x the tensor's largest entry; weights after one Adam step (lr 1e-3)
1e-4 (Adam's first step is ~lr x sign, so summation noise on near-zero gradients shows).
"""

from __future__ import annotations

import pytest
import torch

from policy_testlib import max_abs_diff

pytestmark = pytest.mark.slow

# (worker directory, packed case, padded case)
PAIRS = {"tp1": ("policy", "tp1", "padded_tp1"), "tp2": ("policy", "tp2", "padded_tp2"),
         "pp2": ("policy", "pp2", "padded_pp2"), "cp2": ("cp", "cp2", "padded_cp2")}


@pytest.fixture(scope="module")
def load(parallel_run):
    out = parallel_run["out"]
    return lambda where, case: torch.load(out / where / f"{case}.pt", weights_only=False)


@pytest.mark.parametrize("layout", list(PAIRS))
def test_packed_sequences_equal_padded(layout, load):
    where, packed_case, padded_case = PAIRS[layout]
    packed, padded = load(where, packed_case), load(where, padded_case)
    # the two runs really laid the tokens out differently: one row of several sequences vs one
    # row per sequence
    assert all(p and shape[0] == 1 for p, shape in packed["shapes"])
    assert not any(p for p, _ in padded["shapes"])
    assert max(shape[0] for _, shape in padded["shapes"]) > 1
    assert sum(s[0] * s[1] for _, s in packed["shapes"]) < sum(s[0] * s[1] for _, s in padded["shapes"])
    assert [t.shape for t in packed["logps"]] == [t.shape for t in padded["logps"]]
    assert max_abs_diff(packed["logps"], padded["logps"]) < 3e-6
    assert max_abs_diff(packed["ents"], padded["ents"]) < 3e-6
    m, mp = packed["metrics"], padded["metrics"]
    assert m["loss"] == pytest.approx(mp["loss"], abs=1e-6)
    assert m["tokens"] == mp["tokens"]
    for name in ("logp", "ent"):
        a, b = packed["per_seq"][name], padded["per_seq"][name]
        assert torch.equal(a.isnan(), b.isnan())
        assert float((a - b).nan_to_num().abs().max()) < 3e-6
    assert m["grad_norm"] == pytest.approx(mp["grad_norm"], rel=1e-5)
    assert set(packed["grads"]) == set(padded["grads"])
    for name, ref in padded["grads"].items():
        err = float((packed["grads"][name].double() - ref.double()).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (name, err)
    worst = max(float((packed["weights"][n] - padded["weights"][n]).abs().max()) for n in padded["weights"])
    assert worst < 1e-4
