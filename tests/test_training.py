"""Training: the `turborag finetune` command (the chunk encoder only) and the training mix."""

import json

import pytest


def test_finetune_command_is_registered_from_training():
    from typer.testing import CliRunner

    from turborag_integrations.cli import app
    from turborag_integrations.training.cli import finetune_command

    assert any(c.callback is finetune_command for c in app.registered_commands)
    result = CliRunner().invoke(app, ["finetune", "--help"])
    assert result.exit_code == 0 and "--lora-rank" in result.output
    # the model's weights are never trained: without --encoder the command refuses to run
    result = CliRunner().invoke(app, ["finetune", "out"])
    assert result.exit_code == 2 and "pass --encoder" in result.output


def test_retemplate_moves_one_templates_items_and_leaves_the_rest_of_the_mix(tmp_path):
    from turborag_integrations.training.mix import generate_mix, main, retemplate

    items = generate_mix(60, seed=3)
    before = [dict(it) for it in items]
    refine = sum(it["template"] == "llama_index_refine" for it in items)
    assert refine > 0
    assert retemplate(items, "llama_index_refine", "llama_index_text_qa") == refine
    for old, new in zip(before, items):
        expected = "llama_index_text_qa" if old["template"] == "llama_index_refine" else old["template"]
        assert new == {**old, "template": expected}
    with pytest.raises(ValueError, match="unknown template 'nope'"):
        retemplate(items, "nope", "eval")
    out = tmp_path / "mix.jsonl"
    main(["--out", str(out), "--n", "60", "--seed", "3",
          "--retemplate", "llama_index_refine=llama_index_text_qa"])
    assert [json.loads(line) for line in out.read_text().splitlines()] == items
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--retemplate", "refine"])
