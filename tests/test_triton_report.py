"""tools/triton_report.py's dump step (the project's side; its report step needs Triton's wheel):
each Triton kernel of an op lowered for an H200 on the CPU, written as IR with its launch
options."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_dump_writes_each_kernel(root, tmp_path):
  out = tmp_path / "glu"
  res = subprocess.run([sys.executable, str(root / "tools" / "triton_report.py"), "dump",
                        str(out), "--op", "glu", "--set", "block_m=16"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  meta = json.loads((out / "kernels.json").read_text())
  assert set(meta["kernels"]) == {"glu_fwd", "glu_bwd"}
  for name, opts in meta["kernels"].items():
    assert (out / f"{name}.ttir").read_text().startswith(f"module @{name}")
    assert opts["num_warps"] >= 1 and opts["num_stages"] >= 1
  assert "tensor<16x256xf32>" in (out / "glu_fwd.ttir").read_text()  # the --set tile
  assert meta["sets"] == ["block_m=16"]


@pytest.mark.slow
def test_dump_rejects_an_unknown_option(root, tmp_path):
  res = subprocess.run([sys.executable, str(root / "tools" / "triton_report.py"), "dump",
                        str(tmp_path / "x"), "--op", "glu", "--set", "blockm=16"],
                       capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and "has no option 'blockm'" in res.stderr


def test_programs_per_sm_takes_the_tightest_sm90_limit(root):
  """Registers (256 per warp granule), shared memory (with 1 KiB reserved per program), threads
  and programs, each made the binding limit once."""
  sys.path.insert(0, str(root / "tools"))
  try:
    from triton_report import programs_per_sm
  finally:
    sys.path.pop(0)
  assert programs_per_sm(255, 148504, 8) == 1  # kda_chunk_a: 255 x 32 -> 8192 per warp, x 8
  assert programs_per_sm(255, 32768, 4) == 2   # kda_chunk_dqkg: registers, not its 32 KiB
  assert programs_per_sm(96, 2048, 4) == 5     # 96 x 32 x 4 = 12288 registers
  assert programs_per_sm(32, 120000, 4) == 1   # shared memory: two need 242,048 bytes
  assert programs_per_sm(32, 0, 32) == 2       # threads: 1024 per program
  assert programs_per_sm(8, 0, 1) == 32        # the program limit
