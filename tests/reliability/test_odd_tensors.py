"""Issue 16.5: tensor kinds the store cannot keep exactly (quantized, sparse, nested, conjugate
or negative views) are refused up front with a TypeError naming the key and the kind; nothing
is stored and the store stays usable."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from _faults import rand, small_store


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR is "beta"
        return fn()


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in recent torch
        return torch.quantize_per_tensor(torch.randn(64), 0.1, 0, torch.quint8)[1:]


def _nested():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        return torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)],
                                          layout=torch.jagged)


KINDS = {
    "quantized": (_quantized, r"quantized \(torch.quint8, torch.per_tensor_affine\)",
                  "int_repr"),
    "coo": (lambda: torch.randn(8, 8).to_sparse(), r"sparse \(torch.sparse_coo\)", "to_dense"),
    "csr": (lambda: _quiet(torch.randn(8, 8).to_sparse_csr), r"sparse \(torch.sparse_csr\)",
            "to_dense"),
    "nested": (_nested, "nested", "unbind"),
    "conj": (lambda: torch.randn(8, dtype=torch.complex64).conj(), "conjugate view",
             "resolve_conj"),
    "neg": (lambda: torch.randn(8, dtype=torch.complex64).conj().imag, "negative view",
            "resolve_neg"),
}


@pytest.mark.parametrize("tier", [None, "gpu", "cpu", "nvme"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_inexact_tensor_kinds_are_refused_naming_key_and_kind(tmp_path, kind, tier):
    make, what, fix = KINDS[kind]
    store = small_store(tmp_path)
    store.put("kept", rand(100))
    with pytest.raises(TypeError, match=rf"put\('{kind}'\): a {what} tensor cannot be stored "
                                        rf"exactly .*{fix}"):
        store.put(kind, make(), tier=tier)
    assert kind not in store and store.keys() == ["kept"]
    store.put("after", rand(100, seed=1), tier=tier)  # still usable
    assert torch.equal(store.get("kept", "cpu"), rand(100))
    store.close()


def test_a_resolved_view_is_stored_exactly(tmp_path):
    store = small_store(tmp_path)
    x = torch.randn(8, dtype=torch.complex64)
    store.put("c", x.conj().resolve_conj(), tier="nvme")
    assert torch.equal(store.get("c", "cpu"), x.conj())
    store.close()


def test_a_sliced_quantized_tensor_into_the_gpu_tier_does_not_crash(tmp_path):
    # it segfaulted in _place (clone of its uint8 view): run it where a crash cannot take the
    # test session down with it
    code = ("import warnings, torch; warnings.simplefilter('ignore'); "
            "from tiermem import StoreConfig, TierStore; "
            "s = TierStore(StoreConfig(gpu_bytes=1 << 20, cpu_bytes=1 << 20)); "
            "q = torch.quantize_per_tensor(torch.randn(10), 0.1, 0, torch.quint8)[1:]\n"
            "try:\n    s.put('q', q, tier='gpu')\n"
            "except TypeError as exc:\n    print('refused:', exc)")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "refused: put('q'): a quantized" in out.stdout
