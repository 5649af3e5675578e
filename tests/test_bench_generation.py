"""The generation benchmark on CPU: rows for plain and speculative decoding with both drafters,
acceptance where it is known (self: 1.0), outputs equal to plain greedy decoding in float32."""

import json

import pytest

from ubatch.bench.cli import main
from ubatch.bench.generation import GenerationShape, generation_sweep, make_drafter
from ubatch.models import ModelConfig, build_model


def test_generation_sweep_rows():
    config = ModelConfig.preset("tiny")
    model = build_model(config, device="cpu")
    rows = generation_sweep(
        model,
        config,
        GenerationShape(num_requests=3, prompt_len=5, max_new_tokens=6),
        graph_modes=[False],
        spec_ks=[2],
        drafters=["self", "truncated"],
        capture_sizes=[16],
    )
    assert [(r["drafter"], r["spec_k"]) for r in rows] == [(None, 0), ("self", 2), ("truncated", 2)]
    plain, self_drafted, truncated = rows
    assert all(r["generated_tokens"] == 18 and r["requests_differing"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    assert plain["acceptance_rate"] is None and self_drafted["acceptance_rate"] == 1.0
    assert 0.0 <= truncated["acceptance_rate"] < 1.0
    assert self_drafted["speedup"] == round(self_drafted["tokens_per_s"] / plain["tokens_per_s"], 4)


def test_unknown_drafter_is_named():
    config = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="unknown drafter 'big'; known: self, truncated"):
        make_drafter("big", build_model(config, device="cpu"), config)


def test_cli_generate_workload_writes_a_report(tmp_path, capsys):
    out = tmp_path / "gen.json"
    main(
        [
            "--device",
            "cpu",
            "--workload",
            "generate",
            "--model",
            "dense",
            "--requests",
            "2",
            "--prompt-len",
            "4",
            "--max-new-tokens",
            "3",
            "--spec-k",
            "2",
            "--drafter",
            "self",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["drafter"], r["spec_k"], r["acceptance_rate"]) for r in rows] == [(None, 0, None), ("self", 2, 1.0)]
    assert "tokens/s" in capsys.readouterr().out


def test_cli_rejects_an_unknown_drafter(capsys):
    with pytest.raises(SystemExit):
        main(["--workload", "generate", "--drafter", "self,huge"])
    assert "expected drafters among self, truncated, got 'self,huge'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "0"], "expected a positive integer, got '0'"),
        (["--max-new-tokens", "2,3"], "expected a positive integer, got '2,3'"),
        (["--policy", "auto"], "--policy and --sm-partition apply to single steps"),
    ],
)
def test_cli_generate_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--workload", "generate", *argv])
    assert message in capsys.readouterr().err
