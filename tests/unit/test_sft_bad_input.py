"""`tandem sft` on bad input: each is refused in one line naming the file, the line and the value, before
anything is trained or written, and the model already at the output directory is never replaced by one
trained on nothing (or on NaN)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from tandemrl.cli import main
from tandemrl.config.errors import ConfigError
from tandemrl.data.demos import load_demos
from tandemrl.host.files import InputFileError
from tandemrl.trainer.sft import SampleLimits, read_rendered

LIMITS = SampleLimits(vocab_size=100, max_tokens=16, model="tiny")
PLAN = {
    "id": "q1",
    "question": "Where was Ann born?",
    "golden_answers": ["Oslo"],
    "data_source": "kb_1hop",
    "steps": [
        {"think": "I need her birthplace.", "query": "Ann birthplace", "entity": "Ann", "expect": "Oslo"}
    ],
    "final_think": "Ann was born in Oslo.",
    "answer": "Oslo",
}


def _write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sample(ids: list[int], mask: list[int] | None = None) -> dict:
    return {"input_ids": ids, "loss_mask": [1] * len(ids) if mask is None else mask}


# ----------------------------------------------------------------- actor.sft.rendered_path


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_rendered_file_without_samples_is_refused(tmp_path, text):
    path = tmp_path / "rendered.jsonl"
    path.write_text(text)
    with pytest.raises(InputFileError, match=r"rendered.jsonl' holds no sample \(it is empty\)"):
        read_rendered(path, LIMITS)


@pytest.mark.parametrize("bad_id", [100, 999999, -1, 2**70])
def test_rendered_token_id_outside_the_vocabulary_names_line_and_value(tmp_path, bad_id):
    path = _write_lines(tmp_path / "rendered.jsonl", [_sample([1, 2, 3]), _sample([1, bad_id, 3])])
    with pytest.raises(InputFileError) as error:
        read_rendered(path, LIMITS)
    message = str(error.value)
    assert "line 2" in message and f"token id {bad_id} at position 1" in message
    assert "ids 0 to 99" in message and "\n" not in message


@pytest.mark.parametrize("bad_mask", [5, -3, 2])
def test_rendered_loss_mask_other_than_0_or_1_is_refused(tmp_path, bad_mask):
    path = _write_lines(tmp_path / "rendered.jsonl", [_sample([1, 2, 3], [0, bad_mask, 1])])
    with pytest.raises(InputFileError, match=rf"line 1: `loss_mask` holds {bad_mask} at position 1"):
        read_rendered(path)  # the mask is checked even without a model's limits


def test_rendered_sample_longer_than_the_context_is_refused_and_one_that_fits_is_read(tmp_path):
    fits = _write_lines(tmp_path / "fits.jsonl", [_sample([1] * 16)])
    assert [s.num_tokens for s in read_rendered(fits, LIMITS)] == [16]
    too_long = _write_lines(tmp_path / "long.jsonl", [_sample([1] * 4), _sample([1] * 17)])
    with pytest.raises(InputFileError, match=r"line 2: the sample has 17 tokens, more than .*=16"):
        read_rendered(too_long, LIMITS)


def test_rendered_file_with_no_token_to_train_on_is_refused(tmp_path):
    path = _write_lines(tmp_path / "rendered.jsonl", [_sample([1, 2], [1, 0]), _sample([3], [1])])
    with pytest.raises(InputFileError, match="no sample has a token to train on"):
        read_rendered(path, LIMITS)


# ----------------------------------------------------------------- actor.sft.demos_path


def test_demos_record_without_steps_names_line_and_field(tmp_path):
    no_steps = {key: value for key, value in PLAN.items() if key != "steps"}
    path = _write_lines(tmp_path / "demos.jsonl", [PLAN, no_steps])
    with pytest.raises(InputFileError, match=r"demos.jsonl' line 2: missing `steps`"):
        load_demos(path)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"steps": [{"think": "t", "query": "q", "entity": "e"}]}, r"missing `steps\[0\].expect`"),
        ({"steps": ["a search"]}, r"`steps\[0\]` is not an object"),
        ({"answer": 3}, r"`answer` is int, not a string"),
        ({"data_source": ["kb"]}, r"`data_source` is list, not a string"),
    ],
)
def test_demos_record_with_a_mistyped_field_is_refused(tmp_path, change, expected):
    path = _write_lines(tmp_path / "demos.jsonl", [{**PLAN, **change}])
    with pytest.raises(InputFileError, match=rf"line 1: {expected}"):
        load_demos(path)


def test_empty_demos_file_is_refused_as_empty(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text("\n")
    with pytest.raises(InputFileError, match=r"demos.jsonl' is empty: it holds no demonstration"):
        load_demos(path)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_demos_and_rendered_paths_that_are_not_files_say_what_they_are(tmp_path, kind):
    path = tmp_path / "input"
    if kind == "directory":
        path.mkdir()
        expected = "is a directory, not a file"
    else:
        os.mkfifo(path)
        expected = "is not a regular file"
    for read in (load_demos, read_rendered):
        with pytest.raises(InputFileError, match=expected):
            read(path)


# ----------------------------------------------------------------- `tandem sft`, end to end


def _run_sft(tmp_path: Path, model_dir: Path, capsys, **sft) -> tuple[int, str]:
    config = {
        "runner": {"output_dir": str(tmp_path / "run")},
        "actor": {"model": {"model_path": str(model_dir)}, "device": "cpu", "sft": sft},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    code = main(["sft", str(tmp_path / "sft.yaml")])
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def old_model(tmp_path) -> Path:
    """A previously exported model at the output directory: what a failed cold start must leave alone."""
    out = tmp_path / "coldstart"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    (out / "model.safetensors").write_bytes(b"old weights")
    return out


def _is_untouched(out: Path) -> bool:
    return (
        sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        and (out / "model.safetensors").read_bytes() == b"old weights"
    )


def test_tandem_sft_on_an_empty_rendered_file_keeps_the_old_model(
    tmp_path, tiny_llama_dir, old_model, capsys
):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = _run_sft(
        tmp_path, tiny_llama_dir, capsys, rendered_path=str(tmp_path / "empty.jsonl"), out_dir=str(old_model)
    )
    assert code == 2 and "empty.jsonl' holds no sample" in err and "\n" not in err
    assert _is_untouched(old_model)
    assert not (tmp_path / "run" / "sft").exists()  # refused before the actor or its logger started


def test_tandem_sft_checks_ids_against_the_models_own_vocabulary(tmp_path, tiny_llama_dir, old_model, capsys):
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    rendered = _write_lines(
        tmp_path / "rendered.jsonl", [_sample([1, 2, vocab_size - 1]), _sample([1, vocab_size])]
    )
    code, err = _run_sft(
        tmp_path, tiny_llama_dir, capsys, rendered_path=str(rendered), out_dir=str(old_model)
    )
    assert code == 2 and f"line 2: `input_ids` holds token id {vocab_size} at position 1" in err
    assert _is_untouched(old_model)


def test_tandem_sft_refuses_an_out_dir_under_a_file_before_training(tmp_path, tiny_llama_dir, capsys):
    rendered = _write_lines(tmp_path / "rendered.jsonl", [_sample([1, 2, 3])])
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "x"
    code, err = _run_sft(tmp_path, tiny_llama_dir, capsys, rendered_path=str(rendered), out_dir=str(out))
    # refused by the export's own target check or by `check_creatable`, whichever looks first
    assert code == 2 and str(out) in err and "\n" not in err
    assert "is a file, not a directory" in err or "is not a directory" in err
    assert not (tmp_path / "run" / "sft").exists()


def test_tandem_sft_whose_loss_is_nan_exports_nothing(tmp_path, tiny_llama_dir, old_model, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "nan_model"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, broken / name)
    rendered = _write_lines(tmp_path / "rendered.jsonl", [_sample([1, 2, 3, 4])])
    code, err = _run_sft(tmp_path, broken, capsys, rendered_path=str(rendered), out_dir=str(old_model))
    assert code == 2 and "the SFT loss became nan at update 1/1" in err and "nothing was exported" in err
    assert _is_untouched(old_model)


def test_demos_selection_of_nothing_is_refused_before_rendering(tmp_path, tiny_llama_dir):
    from tandemrl.commands.sft import load_sft_samples
    from tandemrl.config.loader import load_config

    demos = _write_lines(tmp_path / "demos.jsonl", [PLAN])
    overrides = [
        f"actor.model.model_path={tiny_llama_dir}",
        f"actor.sft.demos_path={demos}",
        "actor.sft.num_demos_per_source={kb_1hop: 0}",
        f"runner.output_dir={tmp_path / 'run'}",
    ]
    (tmp_path / "sft.yaml").write_text("{}\n")
    config = load_config(str(tmp_path / "sft.yaml"), overrides)
    with pytest.raises(ConfigError, match="selects no demonstration"):
        load_sft_samples(config)  # no retrieval server is started: it would fail on this bare config
