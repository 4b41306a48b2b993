"""bench/layer_prefill.py through real PyTorch: the layer it times computes what transformers' own
Llama and Qwen3 decoder layers compute (the same weights, the same input), and its timings become a
profile the planner loads, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import lsq_linear

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.layer_prefill import build_layer, layer_forward, rope_tables
from planner.layer_shape import DecoderLayerShape
from planner.profile import load_profile
from tests import planner_store as fx

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 64, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _weights_of(layer, shape: DecoderLayerShape) -> dict:
    """transformers' layer weights in layer_forward's layout (matrices as (in, out))."""
    attn, mlp = layer.self_attn, layer.mlp
    w = {"q": attn.q_proj.weight.T, "k": attn.k_proj.weight.T, "v": attn.v_proj.weight.T,
         "o": attn.o_proj.weight.T, "gate": mlp.gate_proj.weight.T, "up": mlp.up_proj.weight.T,
         "down": mlp.down_proj.weight.T, "norm1": layer.input_layernorm.weight,
         "norm2": layer.post_attention_layernorm.weight}
    if shape.qk_norm:
        w["q_norm"], w["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
    return {k: v.detach().contiguous() for k, v in w.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_timed_layer_is_transformers_decoder_layer(arch):
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(0)
    config = config_cls(**SMALL)
    config._attn_implementation = "eager"  # transformers' own attention, not the SDPA call under test
    model = model_cls(config).eval()
    for p in model.parameters():  # norms start at 1: give them values so a missing norm shows
        if p.ndim == 1:
            p.data.uniform_(0.5, 1.5)
    shape = DecoderLayerShape.from_config(config.to_dict())
    assert shape.qk_norm == (arch == "qwen3")
    ours = build_layer(shape, torch.float32, "cpu")
    theirs = _weights_of(model.model.layers[0], shape)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert sum(v.numel() for v in ours.values()) == shape.params == sum(
        p.numel() for p in model.model.layers[0].parameters())
    ids = torch.randint(0, SMALL["vocab_size"], (1, 50))
    with torch.no_grad():
        hidden = model.model(ids, output_hidden_states=True).hidden_states
        cos, sin = rope_tables(50, shape.head_dim, torch.float32, "cpu", theta=config.rope_parameters["rope_theta"])
        out = layer_forward(theirs, shape, hidden[0], cos, sin)
    assert torch.allclose(out, hidden[1], atol=1e-5, rtol=1e-4), (out - hidden[1]).abs().max()


def test_timings_of_a_small_layer_become_a_profile_the_planner_loads(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL | {"model_type": "llama", "num_hidden_layers": 4}))
    timing = tmp_path / "layer.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "layer_prefill.py"), "--config", str(config),
                          "--tokens", "128,512,1024", "--repeats", "3", "--warmup", "1", "--out", str(timing)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(timing.read_text())
    assert [p["tokens"] for p in doc["points"]] == [128, 512, 1024]
    assert all(len(p["samples_s"]) == 3 and p["layer_s"] == sorted(p["samples_s"])[1] for p in doc["points"])
    out = tmp_path / "measured.yaml"
    cli = subprocess.run([sys.executable, "-m", "turnscope", "profile-from-timing", str(timing),
                          "--base", str(REPO / "data" / "profiles" / "embedded-cpu.yaml"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "prefill curve MEASURED on CPU" in cli.stdout
    profile = load_profile(out)
    # a second route to the same curve: scipy's bounded linear least squares (another solver) on
    # the relative errors of the timed medians, times 4 layers
    x = np.array([p["tokens"] for p in doc["points"]], dtype=float)
    t = np.array([p["layer_s"] for p in doc["points"]])
    a1, a2 = lsq_linear(np.column_stack([x / t, x * x / t]), np.ones_like(t), bounds=(0, np.inf), tol=1e-12).x
    assert profile.prefill_a1_s_per_token.value == pytest.approx(4 * a1, rel=1e-4, abs=1e-12)
    assert profile.prefill_a2_s_per_token2.value == pytest.approx(4 * a2, rel=1e-4, abs=1e-15)
    for p in doc["points"]:  # the CLI's table: 4 layers x each median
        assert f"{p['layer_s'] * 4:8.3f} s for 4 layers" in cli.stdout
    assert "WARNING: timed on a CPU" in cli.stdout
    assert "WARNING: timed on a CPU" in load_profile(out).description  # shown with the profile on the Plan page
    # a plan made with it says where its prefill curve comes from
    trace = REPO / "data" / "traces" / "kv-cache-tester" / "trace_0036.json"
    plan = subprocess.run([sys.executable, "-m", "turnscope", "plan", str(trace), "--profile", str(out),
                           "--store", str(tmp_path / "store")], capture_output=True, text=True, timeout=300, cwd=REPO,
                          check=False)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-2000:]
    said = " ".join(plan.stdout.split())
    assert "prefill curve of profile embedded-cpu-measured: MEASURED" in said and "on CPU" in said, said[:600]
    # the base's held-out errors were of its own curve: none carried over, the report says how to get its own
    assert load_profile(REPO / "data" / "profiles" / "embedded-cpu.yaml").held_out is not None
    assert profile.held_out is None
    assert "no held-out interval yet (the base's held-out errors were of its own curve)" in cli.stdout
    assert "intervals: no held-out interval (profile embedded-cpu-measured was not checked" in said
    # its own held-out check: the measured profile against recorded runs, its errors written with it
    store = fx.build(tmp_path / "runs")
    checked = tmp_path / "measured-checked.yaml"
    chk = subprocess.run([sys.executable, "-m", "turnscope", "plan-check", "--profile", str(out), "--check-store",
                          str(store), "--write-profile", str(checked)], capture_output=True, text=True, timeout=300,
                         cwd=REPO, check=False, env=os.environ | {"COLUMNS": "4000"})
    assert chk.returncode == 0, (chk.stdout + chk.stderr)[-2000:]
    own = load_profile(checked)
    assert own.held_out is not None and f"profile file {out}" in own.held_out.split
    assert set(own.held_out.ttft_ratio) == set(fx.MODES) and own.held_out.runs == len(fx.RUNS)
    assert own.prefill_a1_s_per_token == profile.prefill_a1_s_per_token   # the measured curve, its source kept
    plan = subprocess.run([sys.executable, "-m", "turnscope", "plan", str(trace), "--profile", str(checked),
                           "--store", str(tmp_path / "store2")], capture_output=True, text=True, timeout=300,
                          cwd=REPO, check=False)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-2000:]
    said = " ".join(plan.stdout.split())
    assert "prefill curve of profile embedded-cpu-measured: MEASURED" in said
    assert f"intervals: 80%, from the held-out errors stored with profile embedded-cpu-measured (profile file {out}" in said


def test_a_model_it_cannot_time_exits_2_naming_the_field(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL | {"kv_lora_rank": 512}))
    run = subprocess.run([sys.executable, str(REPO / "bench" / "layer_prefill.py"), "--config", str(config),
                          "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2
    assert f"{config}: field 'kv_lora_rank'" in run.stderr


def test_profile_from_timing_refuses_half_an_anchor_and_a_bad_file(tmp_path):
    base = str(REPO / "data" / "profiles" / "vendor-h200.yaml")
    half = subprocess.run([sys.executable, "-m", "turnscope", "profile-from-timing", str(tmp_path / "x.json"),
                           "--base", base, "--out", str(tmp_path / "p.yaml"), "--anchor-tokens", "4175"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert half.returncode == 2 and "--anchor-tokens/--anchor-ttft-s: give both or neither" in half.stdout + half.stderr
    doc = {"format": "turnscope-layer-timing/1", "config": "c.json", "model_type": "llama",
           "shape": {"hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4, "intermediate": 16, "layers": 2},
           "dtype": "float32", "device": "cpu", "torch": "2", "attention": "sdpa", "measured_at": "now",
           "points": "three"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc, indent=2))
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if '"points"' in text)
    run = subprocess.run([sys.executable, "-m", "turnscope", "profile-from-timing", str(bad), "--base", base,
                          "--out", str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=False)
    said = " ".join((run.stdout + run.stderr).split())  # the console wraps long lines
    assert run.returncode == 2 and f"{bad}: line {line}: layer timing field points" in said, said
    assert not (tmp_path / "p.yaml").exists()
