"""The eyas command line: machine-readable output and clear errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.cli import main

REPO = Path(__file__).resolve().parents[1]

JSON_KEYS = {
    "method",
    "token_ids",
    "text",
    "new_tokens",
    "target_forwards",
    "accept_length_mean",
    "wall_s",
    "tokens_per_s",
}


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--prompt", ""], "prompt"),
        (["--prompt", "   "], "prompt"),
        (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi", "--top-k", "-1"], "top_k"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "hi", "--method", "medusa"], "method"),
        (["--prompt", "hi", "--tree-width", "0"], "tree_width"),
        (["--prompt-ids", "1,x,3"], "prompt_ids"),
        (["--prompt-ids", "1,-4"], "prompt_ids"),
        (["--prompt", "hi", "--request-id", " "], "request_id"),
    ],
)
def test_bad_input_names_the_field(capsys, argv, field):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}:"), err


@pytest.mark.parametrize("name", ["", "r" * 257])
def test_a_bad_cancel_names_request_id_before_connecting(capsys, name):
    assert main(["cancel", name, "--server", "127.0.0.1:1"]) == 2  # nothing listens there: never reached
    assert capsys.readouterr().err.strip().startswith("error: request_id:")


def test_bad_training_config_names_the_field(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("method: eagle3\nttt_steps: 0\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "config.ttt_steps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("applications: [{name: other, args: {}}]", "applications[other]: eyas serve runs the 'eyas' application only"),
        ("applications: []", "applications: no application named 'eyas'"),
        ("applications: [{name: eyas, deployments: [{name: EyasTarget, num_replicas: 3}]}]", "target_replicas"),
        ("applications: {eyas: 1}", "applications: must be a list of mappings"),
        ("- just\n- a list", "a Serve config is a mapping"),
        ("applications: [{name: eyas, args: [1]}]", "applications[eyas].args: must be a mapping"),
        ("applications: [{name: eyas, args: {target_replicas: 0}}]", "target_replicas"),
        ("applications: [{name: eyas, args: {nonsense_key: 1}}]", "nonsense_key"),
        ("applications: [name: eyas", "not valid YAML"),
    ],
)
def test_serve_refuses_a_bad_config_before_starting_ray(tmp_path, capsys, text, message):
    """`eyas serve --config` fails with exit code 2 and a message naming the field; before this, a file
    whose application was not named `eyas` silently served the defaults. No Ray is started (a started
    one would block here)."""
    import ray

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text + "\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()


def test_serve_takes_its_addresses_from_the_config_unless_a_flag_says_otherwise(tmp_path, capsys):
    """--check-config prints what `eyas serve` would start: the shipped ray_configs/serve.yaml's ports
    (gRPC 9000, HTTP 8000 on 127.0.0.1); a file's own ports; a flag over the file; defaults without one."""
    import ray

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "http_options: {host: 0.0.0.0, port: 8123}\ngrpc_options: {port: 9123}\n"
        "applications: [{name: eyas, args: {target_replicas: 2}}]\n"
    )

    def check(*argv):
        assert main(["serve", "--check-config", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    assert check("--config", str(cfg)) == {
        "endpoints": {"host": "0.0.0.0", "http_port": 8123, "grpc_port": 9123},
        "args": {"target_replicas": 2},
        "devices": {"target": "cpu", "drafter": "cpu"},
    }
    assert check("--config", str(cfg), "--grpc-port", "7000")["endpoints"]["grpc_port"] == 7000
    assert check()["endpoints"] == {"host": "127.0.0.1", "http_port": 8000, "grpc_port": 9000}
    shipped = check("--config", str(REPO / "ray_configs" / "serve.yaml"))
    assert shipped["endpoints"] == {"host": "127.0.0.1", "http_port": 8000, "grpc_port": 9000}
    cfg.write_text("grpc_options: {port: 70000}\napplications: [{name: eyas}]\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "grpc_options.port: must be a port number" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_a_gpu_reservation_sets_the_replicas_device_and_a_contradiction_is_refused_or_warned(tmp_path, capsys):
    """`target_num_gpus: 1` makes the target replicas compute on the GPU Ray assigns them ("cuda"), and
    --check-config shows each kind's device; `device: cpu` beside a reservation, or a GPU device with
    none, is warned about naming the field; fp16w on a reserved GPU and an unknown device are refused,
    naming the field; `--device` overrides the file. Nothing starts Ray."""
    import ray

    cfg = tmp_path / "serve.yaml"

    def check(args: str, *flags: str) -> tuple[int, dict | None, str]:
        cfg.write_text(f"applications: [{{name: eyas, args: {{{args}}}}}]\n")
        rc = main(["serve", "--check-config", "--config", str(cfg), *flags])
        captured = capsys.readouterr()
        return rc, json.loads(captured.out) if rc == 0 else None, captured.err

    rc, out, err = check("target_num_gpus: 1, drafter_num_gpus: 0.5")
    assert rc == 0 and out["devices"] == {"target": "cuda", "drafter": "cuda"} and "warnings" not in out
    rc, out, err = check("target_num_gpus: 1")
    assert out["devices"] == {"target": "cuda", "drafter": "cpu"} and "warnings" not in out and not err
    rc, out, err = check("target_num_gpus: 1, drafter_num_gpus: 0.5, device: cpu")
    assert [w.split(":")[0] for w in out["warnings"]] == ["config.target_num_gpus", "config.drafter_num_gpus"]
    assert "warning: config.target_num_gpus: 1 reserves GPUs that each target replica does not use" in err
    rc, out, err = check("target_num_gpus: 0", "--device", "cuda:1")
    assert out["devices"] == {"target": "cuda:1", "drafter": "cuda:1"}
    assert out["warnings"][0].startswith("config.device: cuda:1 for target replicas that reserve no GPU")
    rc, out, err = check("target_num_gpus: 1, precision: fp16w")
    assert (
        rc == 2
        and "config.precision: fp16w (fbgemm kernels) runs on the CPU only, not on the GPU that "
        "target_num_gpus reserves"
        in err
    )
    rc, out, err = check("target_num_gpus: 1, precision: fp16w, device: cpu")
    assert rc == 0 and out["devices"]["target"] == "cpu"
    rc, out, err = check("device: tpu")
    assert rc == 2 and "config.device: 'tpu' is not" in err
    rc, out, err = check("target_num_gpus: 0")
    assert rc == 0 and out["devices"] == {"target": "cpu", "drafter": "cpu"} and "warnings" not in out and not err
    assert not ray.is_initialized()


def test_a_half_precision_dtype_is_a_config_field_and_refused_beside_fp16w_naming_it(tmp_path, capsys):
    """`dtype` in the serve config and `--dtype` on generate: bfloat16 at precision fp32 is accepted;
    beside fp16w (which computes in float32) both refuse it, naming the field, before any model loads."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("applications: [{name: eyas, args: {dtype: bfloat16}}]\n")
    assert main(["serve", "--check-config", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["args"]["dtype"] == "bfloat16"
    cfg.write_text("applications: [{name: eyas, args: {dtype: bfloat16, precision: fp16w}}]\n")
    assert main(["serve", "--check-config", "--config", str(cfg)]) == 2
    assert "config.dtype: bfloat16 needs precision fp32" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--dtype", "bfloat16", "--precision", "fp16w"]) == 2
    assert capsys.readouterr().err.startswith("error: dtype: bfloat16 needs precision fp32")
    assert main(["generate", "--prompt", "hi", "--dtype", "bf16"]) == 2
    assert capsys.readouterr().err.startswith("error: dtype: 'bf16' is not one of")


def test_a_device_is_checked_before_the_model_loads_naming_the_field(capsys):
    """`--device`: one that does not parse, one this machine lacks, and a GPU beside fp16w are each
    refused at once, naming the field."""
    import torch

    assert main(["generate", "--prompt", "hi", "--device", "tpu"]) == 2
    assert capsys.readouterr().err.startswith("error: device: 'tpu' is not")
    if not torch.cuda.is_available():
        assert main(["generate", "--prompt", "hi", "--device", "cuda:3"]) == 2
        assert capsys.readouterr().err.startswith("error: device: cuda:3 is not available on this machine")
    assert main(["generate", "--prompt", "hi", "--device", "meta", "--precision", "fp16w"]) == 2
    assert capsys.readouterr().err.startswith("error: precision: fp16w (fbgemm kernels) runs on the CPU only")


@pytest.mark.real_model
def test_generate_json_and_out_of_vocabulary_ids(capsys, real_eyas):
    assert main(["generate", "--prompt", "Say hi.", "--method", "target", "--max-new-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(report)
    assert report["new_tokens"] == len(report["token_ids"]) <= 4
    assert report["accept_length_mean"] == pytest.approx(report["new_tokens"] / max(report["target_forwards"], 1))
    assert main(["generate", "--prompt-ids", "1,2,4000000", "--method", "target"]) == 2
    assert capsys.readouterr().err.startswith("error: prompt_ids:")


def test_train_device_and_dtype_are_checked_before_anything_loads(capsys):
    """`eyas train --device/--dtype` override the config; a bad value is refused naming the field."""
    config = str(REPO / "configs" / "release" / "eagle3.yaml")
    assert main(["train", "--config", config, "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.startswith("error: config.dtype: Input should be")
    assert main(["train", "--config", config, "--device", "tpu"]) == 2
    assert "device: 'tpu' is not" in capsys.readouterr().err


@pytest.mark.real_model
def test_trim_vocab_counts_the_answers_and_writes_a_loadable_drafter(capsys, tmp_path):
    """`eyas trim-vocab` on an EAGLE-3 drafter for the real target: the kept tokens are the most
    frequent of the drafter's own in the train answers, coverage is printed, and bad flags are named."""
    import torch

    from eyas.drafting.manifest import load_drafter, manifest_for, save_drafter
    from eyas.drafting.model import DrafterConfig, drafter_feature_address, init_drafter
    from eyas.target.loader import load_target_head, load_tokenizer

    head, tok = load_target_head("smollm2-135m"), load_tokenizer("smollm2-135m")
    drafter = init_drafter(DrafterConfig.for_target("eagle3", head.cfg, draft_vocab_size=64), seed=3)
    answer = "blue blue blue sky sky light"
    ids = tok(answer, add_special_tokens=False)["input_ids"]  # the answer's own tokens, in d2t
    d2t = sorted(set(ids) | set(range(100, 164 - len(set(ids)))))
    drafter.set_draft_vocab(torch.tensor(d2t))
    taps = drafter_feature_address(drafter.cfg, head.cfg)
    save_drafter(tmp_path / "d", drafter, manifest_for("eagle3", drafter, head.fingerprint, taps))
    answers = tmp_path / "regen"
    answers.mkdir()
    rec = {"id": "a", "messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": answer}]}
    for name in ("train", "heldout"):
        path = answers / f"smollm2-135m-sharegpt-{name}.answers.jsonl"
        path.write_text(json.dumps({**rec, "new_tokens": len(ids), "truncated": False}) + "\n")
    flags = ["trim-vocab", "--drafter", str(tmp_path / "d"), "--answers-dir", str(answers)]
    assert main([*flags, "--size", "8", "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "coverage of the train answers' tokens:" in out and "coverage of the held-out answers' tokens:" in out
    trimmed, manifest = load_drafter(tmp_path / "t", head.fingerprint, taps)
    assert trimmed.cfg.draft_vocab_size == 8 and set(ids) <= set(trimmed.d2t.tolist())
    assert "8 most frequent" in manifest.recipe["draft_vocab_trimmed"]
    assert main([*flags, "--size", "65", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: --size: must lie in [1, 64]")
    assert main([*flags[:3], "--answers-dir", str(tmp_path), "--size", "8", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: --answers-dir:")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "--server", "127.0.0.1:9"],
        ["cancel", "r1", "--server", "127.0.0.1:9"],
        ["generate", "--prompt", "hi", "--server", "127.0.0.1:9"],
    ],
)
def test_a_client_command_with_no_server_there_says_so_in_one_line(argv, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --server 127.0.0.1:9: no Eyas server answers there") and "\n" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("eyas ")


def test_serve_model_in_one_line_resolves_to_the_app_args(tmp_path, capsys):
    """`eyas serve MODEL [--precision P] [--drafter DIR]`: the drafter's manifest names its method;
    another model with no drafter of its own serves target-only (said on stderr); a model that does not
    exist is refused naming it."""
    import json

    assert (
        main(
            [
                "serve",
                "--check-config",
                "smollm2-135m",
                "--precision",
                "gguf",
                "--drafter",
                "drafters/smollm2-135m-eagle1",
            ]
        )
        == 0
    )
    args = json.loads(capsys.readouterr().out)["args"]
    assert args == {
        "target": "smollm2-135m",
        "precision": "gguf",
        "methods": ["eagle1"],
        "drafters": {"eagle1": "drafters/smollm2-135m-eagle1"},
    }
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert main(["serve", "--check-config", str(other)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["args"] == {"target": str(other), "methods": [], "drafter_replicas": 0}
    assert "target-only" in out.err
    assert main(["serve", "--check-config", str(tmp_path / "missing.gguf")]) == 2
    assert capsys.readouterr().err.startswith("error: model:")
