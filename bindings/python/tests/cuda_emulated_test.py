"""The Python binding's device paths against libseqgrad built with the CPU emulation of the CUDA backend
(//cabi:emulated/libseqgrad.so, loaded first: _native.so's libseqgrad.so.0.7 then resolves to it). Emulated device
memory faults on any host access, so views that were not copies would crash the test."""
import ctypes
import os
import sys

if len(sys.argv) > 1 and sys.argv[1].endswith(".so"):  # as the test's main: the library's path (BUILD's args)
    os.environ["SG_TEST_EMULATED_LIBSEQGRAD"] = os.path.abspath(sys.argv.pop(1))
ctypes.CDLL(os.environ["SG_TEST_EMULATED_LIBSEQGRAD"], mode=ctypes.RTLD_GLOBAL)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import seqgrad  # noqa: E402

BATCH = [[(i * 7 + 3) % 50 for i in range(24)], [(i * 5 + 1) % 50 for i in range(16)]]


def test_model_on_the_emulated_gpu_matches_the_cpu(tmp_path):
    with seqgrad.Model.from_preset("tiny", dtype="f64", seed=2, device="cuda") as gpu, \
            seqgrad.Model.from_preset("tiny", dtype="f64", seed=2) as cpu:
        assert gpu.device == "cuda" and cpu.device == "cpu"
        gp, cp = gpu.parameters(), cpu.parameters()
        assert gp.keys() == cp.keys()
        for name in cp:
            assert gp[name].flags["OWNDATA"]  # a copy, not a view of device memory
            assert np.array_equal(gp[name], cp[name]), name
        for m in (gpu, cpu):
            with seqgrad.Trainer(m, strategy="seco", chunk=8, page_size=4) as tr:
                tr.compute_gradients(BATCH)
        gg, cg = gpu.gradients(), cpu.gradients()
        for name in cg:
            np.testing.assert_allclose(gg[name], cg[name], rtol=1e-9, atol=1e-12, err_msg=name)
        # A copy's writes stay in the copy; set_parameter reaches the device.
        w = gpu.parameters()["model.norm.weight"]
        w[:] = 7.0
        assert not np.any(gpu.parameters()["model.norm.weight"] == 7.0)
        gpu.set_parameter("model.norm.weight", np.full(32, 0.5))
        assert np.all(gpu.parameters()["model.norm.weight"] == 0.5)
        gpu.save(tmp_path / "m")
        with seqgrad.Model.load(tmp_path / "m", dtype="f64", device="cuda") as loaded:
            assert loaded.device == "cuda"
            assert np.all(loaded.parameters()["model.norm.weight"] == 0.5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
