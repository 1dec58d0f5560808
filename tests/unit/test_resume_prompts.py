"""After a resume the prompts open at the save come first (or, with runner.reissue_on_resume=false, are
skipped), and one log line gives the count; and the run's engine clients get the key of their engines."""

from __future__ import annotations

import logging

import pytest

from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.data.loader import Prompt
from tandemrl.runner.checkpoint import resume_prompts
from tandemrl.runner.prompt_feed import PromptFeed

PROMPTS = [Prompt(f"train:{i}", f"q{i}", [f"a{i}"], "kb") for i in range(10)]


class ListLoader:
    """Stands in for PromptLoader: hands out PROMPTS from 5 on, wrapping (what follows the saved position)."""

    def __init__(self):
        self.next_index = 5

    def next_prompts(self, num: int) -> list[Prompt]:
        out = [PROMPTS[(self.next_index + k) % len(PROMPTS)] for k in range(num)]
        self.next_index += num
        return out


STATE = {
    "step": 2,
    "num_inflight": 2,
    "num_buffered": 1,
    "num_prefetched": 1,
    "num_skipped_on_resume": 4,
    "open_prompt_ids": ["train:1", "train:3", "train:2", "train:4"],
}


def _draw(reissue: bool, state: dict, caplog) -> tuple[list[str], list[str]]:
    feed = PromptFeed(ListLoader(), prefetch=2)
    with caplog.at_level(logging.INFO, logger="tandemrl"):
        feed.reissue(resume_prompts(state, {p.prompt_id: p for p in PROMPTS}, reissue, "ckpt"))
    drawn = [feed.next().prompt_id for _ in range(6)]
    return drawn, [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]


def test_open_prompts_are_issued_first_and_counted_once(caplog):
    drawn, lines = _draw(True, STATE, caplog)
    assert drawn == ["train:1", "train:3", "train:2", "train:4", "train:5", "train:6"]
    assert len(lines) == 1 and lines[0].endswith("; 4 prompts re-issued"), lines


def test_the_old_skip_behaviour_stays_behind_a_key(caplog):
    drawn, lines = _draw(False, STATE, caplog)
    assert drawn == ["train:5", "train:6", "train:7", "train:8", "train:9", "train:0"]
    assert len(lines) == 1 and "0 prompts re-issued, 4 skipped" in lines[0]
    assert "runner.reissue_on_resume=false" in lines[0]
    assert load_config(None, ["runner.reissue_on_resume=false"]).runner.reissue_on_resume is False
    assert load_config(None).runner.reissue_on_resume is True


def test_a_checkpoint_from_other_data_is_refused():
    state = dict(STATE, open_prompt_ids=["other:1"])
    with pytest.raises(ConfigError, match="not in data.train_data_paths"):
        resume_prompts(state, {p.prompt_id: p for p in PROMPTS}, True, "ckpt")


def test_external_engine_keys_come_from_config_or_environment(monkeypatch):
    from tandemrl.runner.services import external_engine_api_key

    monkeypatch.delenv("TANDEM_ENGINE_API_KEY", raising=False)
    monkeypatch.setenv("SGLANG_API_KEY", "from-sglang-env")
    external = ["rollout.backend=sglang", "rollout.server_addrs=[127.0.0.1:30000]"]
    assert external_engine_api_key(load_config(None, external).rollout) == "from-sglang-env"
    monkeypatch.setenv("TANDEM_ENGINE_API_KEY", "from-tandem-env")
    assert external_engine_api_key(load_config(None, external).rollout) == "from-tandem-env"
    config = load_config(None, external + ["rollout.api_key=from-config"])
    assert external_engine_api_key(config.rollout) == "from-config"


def test_launched_engines_share_the_runs_fresh_key(tmp_path, monkeypatch):
    """The servers a run launches (two engines, the retrieval server) get fresh keys of the run's own,
    in their environment and never on their command line."""
    from tandemrl.cluster.server_supervisor import build_server
    from tandemrl.runner.services import Services

    (tmp_path / "model").mkdir()
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")  # what makes a directory an index
    config = load_config(
        None,
        [
            f"rollout.model.model_path={tmp_path / 'model'}",
            f"retrieval.index_dir={tmp_path / 'index'}",
            "rollout.device=cpu",
            "actor.device=cpu",
            "rollout.instances=2",
            "cluster.use_ray=false",
        ],
    )
    monkeypatch.setenv("TANDEM_ENGINE_API_KEY", "a-key-for-external-engines")
    services = Services(config)
    local, remote = services._specs()
    assert not remote and len(local) == 3  # the retrieval server and two engines, all local
    engine_specs = [spec for _, spec, _ in local if spec.kind == "embedded"]
    assert {spec.api_key for spec in engine_specs} == {services.engine_api_key}
    assert services.engine_api_key not in (None, "a-key-for-external-engines")
    assert services.retrieval_api_key not in (None, services.engine_api_key)
    for _, spec, _ in local:
        server = build_server(spec, "127.0.0.1")
        key = spec.api_key
        assert key in server.env.values()  # TANDEM_ENGINE_API_KEY / TANDEM_RETRIEVAL_API_KEY
        assert key not in " ".join(server.command())


def test_a_row_lost_to_a_kill_after_the_checkpoint_is_written_on_resume(tmp_path, caplog):
    """A saving step logs its row after the save (the row times it); killed in between, the run resumes
    from a checkpoint whose step has no row. The checkpoint keeps the row as it stood, and the resume
    writes it, marked, only when it is missing and is the next step of the history."""
    from tandemrl.metrics.logger import MetricsLogger, read_history
    from tandemrl.runner.checkpoint import RESTORED_METRIC, ROW_KEY, restore_row

    def rows(path):
        return [(r["step"], r.get("val/em/all"), r.get(RESTORED_METRIC)) for r in read_history(path)]

    logger = MetricsLogger(tmp_path, max_steps=6, start_step=0, show_progress=False)
    for step in (1, 2, 3, 4):
        logger.log(step, {"time/step": 1.0})
    state = {"step": 5, ROW_KEY: {"val/em/all": 0.5, "rollout/reward/mean": 0.25}}
    caplog.set_level(logging.WARNING, logger="tandemrl")
    assert restore_row(logger, state) is True
    assert rows(logger.jsonl_path)[-1] == (5, 0.5, 1.0)
    assert any("row of step 5 was missing" in m for m in caplog.messages)
    assert restore_row(logger, state) is False  # once there, not again
    older = {"step": 3, ROW_KEY: {"val/em/all": 0.1}}
    assert restore_row(logger, older) is False  # an older checkpoint's step has its row (or a later one)
    assert restore_row(logger, {"step": 6}) is False  # a checkpoint from before rows were kept
    fresh = MetricsLogger(tmp_path / "fresh", max_steps=6, start_step=5, show_progress=False)
    assert restore_row(fresh, {"step": 6, ROW_KEY: {"val/em/all": 0.5}}) is False  # no history there
    assert [r[0] for r in rows(logger.jsonl_path)] == [1, 2, 3, 4, 5]
