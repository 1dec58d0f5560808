"""Loader resume across processes: stop mid-epoch, save the position, restore it in a new Python
process — the next 100 prompts must be the ones an uninterrupted run produces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandemrl.data.kb import generate_kb
from tandemrl.data.loader import PromptLoader

RESUME_SCRIPT = """
import json, sys
from tandemrl.data.loader import PromptLoader
paths, state_path = json.loads(sys.argv[1]), sys.argv[2]
loader = PromptLoader(paths, seed=7)
with open(state_path) as f:
    loader.load_state_dict(json.load(f))
print(json.dumps([p.prompt_id for p in loader.next_prompts(100)]))
"""


def test_resume_in_a_new_process_replays_the_next_100_prompts(tmp_path):
    kb = generate_kb(tmp_path / "kb", seed=1, num_entities=300, num_train=400, num_val=30, num_test=30)
    paths = [str(kb / "train.jsonl"), str(kb / "val.jsonl")]  # 430 prompts
    uninterrupted = PromptLoader(paths, seed=7)
    expected = [p.prompt_id for p in uninterrupted.next_prompts(800 + 100)]
    first = PromptLoader(paths, seed=7)
    first.next_prompts(800)  # epoch 1, mid-epoch; the next 100 cross into epoch 2
    assert first.position == (1, 370)
    state_path = tmp_path / "data.json"
    state_path.write_text(json.dumps(first.state_dict()))
    repo_root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, json.dumps(paths), str(state_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo_root,
        timeout=120,
    )
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(resumed) == 100
    assert resumed == expected[800:]
