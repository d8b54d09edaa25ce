"""tools/triton_report.py's dump step (the project's side; its report step needs Triton's wheel):
each Triton kernel of an op lowered for an H200 on the CPU, written as IR with its launch
options."""

import json
import subprocess
import sys


def test_dump_writes_each_kernel(root, tmp_path):
  out = tmp_path / "glu"
  res = subprocess.run([sys.executable, str(root / "tools" / "triton_report.py"), "dump",
                        str(out), "--op", "glu", "--set", "pallas_kernels.glu.gpu:BLOCK_M=16"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  meta = json.loads((out / "kernels.json").read_text())
  assert set(meta["kernels"]) == {"glu_fwd", "glu_bwd"}
  for name, opts in meta["kernels"].items():
    assert (out / f"{name}.ttir").read_text().startswith(f"module @{name}")
    assert opts["num_warps"] >= 1 and opts["num_stages"] >= 1
  assert "tensor<16x256xf32>" in (out / "glu_fwd.ttir").read_text()  # the --set tile
  assert meta["sets"] == ["pallas_kernels.glu.gpu:BLOCK_M=16"]


def test_dump_rejects_an_unknown_option(root, tmp_path):
  res = subprocess.run([sys.executable, str(root / "tools" / "triton_report.py"), "dump",
                        str(tmp_path / "x"), "--op", "glu", "--set",
                        "pallas_kernels.glu.gpu:BLOCKM=16"], capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "has no option 'BLOCKM'" in res.stderr
