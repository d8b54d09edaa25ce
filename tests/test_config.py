import pytest

from k3jax import config
from k3jax.config import ConfigError
from conftest import ROOT

PRESETS = ["k3", "kimi_linear_48b", "k3_tiny", "k3_1b"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_frozen(name):
  cfg = config.load(ROOT / "configs" / f"{name}.yaml")
  assert cfg.model.name == name
  with pytest.raises(Exception):
    cfg.model.hidden_size = 1  # frozen


def test_k3_layer_pattern():
  m = config.load(ROOT / "configs" / "k3.yaml").model
  mla = [i + 1 for i in range(m.num_layers) if m.layer_kind(i) == "mla"]
  assert mla == list(range(4, 93, 4)) + [93]
  assert sum(m.is_moe(i) for i in range(m.num_layers)) == 92


def test_overrides_apply_and_validate():
  cfg = config.load(ROOT / "configs" / "k3_tiny.yaml",
                    ["train.steps=7", "model.moe.top_k=2", "data.seq_len=64", "model.mla_layers=[1]"])
  assert (cfg.train.steps, cfg.model.moe.top_k, cfg.data.seq_len) == (7, 2, 64)
  assert cfg.model.mla_layers == (1,)
  again = config.replace(cfg, ["train.steps=9"])
  assert again.train.steps == 9 and again.model == cfg.model


@pytest.mark.parametrize("override, key", [
    ("model.foo=1", "model.foo"),
    ("model.hidden_size=abc", "model.hidden_size"),
    ("model.moe.top_k=17", "model.moe.top_k"),
    ("model.num_layers=3", "model.mla_layers"),
    ("model.kda.head_dim=96", "model.kda.head_dim"),
    ("model.kda.gate=relu", "model.kda.gate"),
    ("model.remat_skip=6", "model.remat_skip"),
    ("model.attn_res.enabled=maybe", "model.attn_res.enabled"),
    ("train.batch_size=0", "train.batch_size"),
    ("mesh.data=-1", None),
    ("mesh.expert_axes=[expert,context]", None),
    ("mesh.expert_axes=[expert,tensor]", "mesh.expert_axes"),
    ("mesh.expert_axes=[]", "mesh.expert_axes"),
    ("model.glu_implementation=xla", None),
    ("model.glu_implementation=triton", "model.glu_implementation"),
    ("optimizer.ns_form=sums", None),
    ("optimizer.ns_form=cubic", "optimizer.ns_form"),
    ("train.log_every=0", "train.log_every"),
    ("model.mla.qk_nope_head_dim=0", "model.mla.qk_nope_head_dim"),
    ("model.mla.v_head_dim=0", "model.mla.v_head_dim"),
    ("optimizer.lr=-1e-3", "optimizer.lr"),
    ("optimizer.lr=nan", "optimizer.lr"),
    ("train.eval_batches=0", "train.eval_batches"),
    ("model.kda.implementation=fast", "model.kda.implementation"),
    ("model.mla.implementation=flash", "model.mla.implementation"),
    ("model.moe.implementation=megablocks", "model.moe.implementation"),
    ("model.kda.implementation=chunked", None),
])
def test_config_errors_name_the_key(override, key):
  if key is None:  # a valid override
    config.load(ROOT / "configs" / "k3_tiny.yaml", [override])
    return
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    config.load(ROOT / "configs" / "k3_tiny.yaml", [override])


def test_model_level_choices_default_to_the_kernels_and_the_polynomial_step():
  cfg = config.load(ROOT / "configs" / "k3_tiny.yaml")
  assert cfg.model.glu_implementation is None  # the pair kernels on GPU, XLA elsewhere
  assert cfg.optimizer.ns_form == "polynomial"


def test_missing_file_and_bad_override():
  with pytest.raises(ConfigError, match="does not exist"):
    config.load("configs/nope.yaml")
  with pytest.raises(ConfigError, match="key=value"):
    config.load(ROOT / "configs" / "k3_tiny.yaml", ["train.steps"])


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("3E-4", 3e-4), ("-2e+1", -20.0),
                                         ("5", 5.0)])
def test_numbers_yaml_reads_as_strings_are_numbers(text, value, tmp_path):
  """YAML 1.1 reads 1e-3 (no dot) as a string; a float key takes it as the number it spells, in
  an override and in a file; a word is still refused."""
  assert config.load(ROOT / "configs" / "k3_tiny.yaml",
                     [f"model.init_std={text}"]).model.init_std == value
  path = tmp_path / "c.yaml"
  path.write_text(f"model:\n  init_std: {text}\n")
  assert config.load(path).model.init_std == value
  assert config.load(ROOT / "configs" / "k3_tiny.yaml", ["optimizer.lr=1e-3"]).optimizer.lr == 1e-3


def test_implementation_choices_are_the_kernels():
  import pallas_kernels.kda, pallas_kernels.mla, pallas_kernels.moe
  for part, names in config.IMPLEMENTATIONS.items():
    assert names == getattr(pallas_kernels, part).IMPLEMENTATIONS
  with pytest.raises(ConfigError, match="model.init_std"):
    config.load(ROOT / "configs" / "k3_tiny.yaml", ["model.init_std=small"])
