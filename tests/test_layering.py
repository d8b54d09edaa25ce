"""The layers import one way: entry scripts -> k3jax -> sharding -> pallas_kernels. Parallelism
knows no model (from k3jax, sharding imports only k3jax.config) and the kernels know neither; the
sharding layout holds only inside its ``with`` block."""

import ast
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import sharding
from conftest import ROOT
from k3jax.config import MeshConfig
from sharding.rules import DEFAULT_RULES, Layout, active_layout, logical_spec


def imported_modules(path, package: str) -> set[str]:
  """Every module a Python file of ``package`` imports (absolute names; relative imports resolved
  against the package), at any depth of the file (imports inside functions count too)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
      out.update(f"{base}.{a.name}" for a in node.names)
      out.add(base)
  return out


def _top(name: str, *tops: str) -> bool:
  return any(name == t or name.startswith(t + ".") for t in tops)


@pytest.mark.parametrize("layer, allowed", [("sharding", ("k3jax.config",)), ("pallas_kernels", ())])
def test_lower_layers_do_not_import_the_model(layer, allowed):
  """sharding/ imports from k3jax only k3jax.config; pallas_kernels/ imports nothing of k3jax
  or sharding."""
  files = sorted((ROOT / layer).rglob("*.py"))
  assert files
  bad = {}
  for path in files:
    imported = imported_modules(path, ".".join(path.relative_to(ROOT).parts[:-1]))
    names = {n for n in imported if _top(n, "k3jax", "sharding")
             and not _top(n, layer) and not _top(n, *allowed)}
    if names:
      bad[str(path.relative_to(ROOT))] = sorted(names)
  assert not bad, bad


def test_the_import_check_sees_every_form(tmp_path):
  """The check reads ``import a.b``, ``from a import b``, relative imports and imports inside
  functions."""
  path = tmp_path / "probe.py"
  path.write_text("import k3jax.model\nfrom k3jax import router\n"
                  "def f():\n  from .. import rules\n  from k3jax.config import Config\n")
  got = imported_modules(path, "sharding.sub")
  assert {"k3jax.model", "k3jax.router", "sharding.rules", "k3jax.config"} <= got


@pytest.mark.parametrize("first", ["sharding", "sharding.mesh", "sharding.expert_parallel",
                                   "k3jax.router", "k3jax.train_state"])
def test_any_module_imports_first(first):
  """No package depends on the order its modules are imported in."""
  proc = subprocess.run([sys.executable, "-c", f"import {first}; import k3jax.train"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_layout_holds_only_inside_its_block():
  default = active_layout()
  assert default == Layout() and default.rules == DEFAULT_RULES
  axes = ("data", "fsdp", "expert", "context")
  outer = MeshConfig(expert_axes=("expert", "context"), moonep=False)
  with sharding.layout(outer):
    assert active_layout() == Layout(("expert", "context"), False)
    assert logical_spec(("expert",), None, axes) == jax.sharding.PartitionSpec(("expert", "context"))
    with sharding.layout(MeshConfig(expert_axes=("data",))):
      assert active_layout() == Layout(("data",), True)
    # serving: no MoonEP, no ZeRO-3 split (heads over tensor only), the experts' rule kept
    with sharding.layout(MeshConfig(), serving=True):
      assert active_layout() == Layout(("expert",), False, True)
      served = axes + ("tensor",)
      assert logical_spec(("embed", "heads"), None, served) == jax.sharding.PartitionSpec(None, "tensor")
      assert logical_spec(("expert", "latent", "mlp"), None, served) == jax.sharding.PartitionSpec(
          "expert", None, "tensor")
    assert active_layout() == Layout(("expert", "context"), False)
  assert active_layout() == default
  assert logical_spec(("expert",), None, axes) == jax.sharding.PartitionSpec("expert")
  with pytest.raises(RuntimeError), sharding.layout(outer):
    raise RuntimeError("the block fails")
  assert active_layout() == default


def test_a_layout_change_traces_again():
  """The layout is part of JAX's tracing cache key: a function traced under one layout is traced
  again under another, never reused."""
  f = jax.jit(lambda x: x * (2 if active_layout().moonep else 3))
  x = jnp.ones(())
  assert float(f(x)) == 2
  with sharding.layout(MeshConfig(moonep=False)):
    assert float(f(x)) == 3
  assert float(f(x)) == 2
