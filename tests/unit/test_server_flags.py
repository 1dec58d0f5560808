"""`tandem serve-engine` and `tandem serve-retrieval` refuse absurd flag values in one argparse line (exit 2)
instead of meeting them later: `--dtype bogus` was torch's AttributeError, `--max-request-mb inf` an
OverflowError, and `--max-running-requests 0` a server that answered /health and never a /generate."""

from __future__ import annotations

import pytest

from tandemrl.cli import build_parser

ENGINE = ["serve-engine", "--model", "m", "--port", "0"]
RETRIEVAL = ["serve-retrieval", "--index", "i"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (ENGINE + ["--device", "tpu"], "--device"),
        (ENGINE + ["--dtype", "bogus"], "--dtype"),
        (ENGINE + ["--max-running-requests", "0"], "--max-running-requests"),
        (ENGINE + ["--max-context-len", "-5"], "--max-context-len"),
        (ENGINE + ["--max-request-mb", "nan"], "--max-request-mb"),
        (ENGINE + ["--health-stall-s", "nan"], "--health-stall-s"),
        (ENGINE + ["--weight-update-timeout-s", "-1"], "--weight-update-timeout-s"),
        (["serve-engine", "--model", "m", "--port", "99999"], "--port"),
        (RETRIEVAL + ["--max-request-mb", "inf"], "--max-request-mb"),
        (RETRIEVAL + ["--max-request-mb", "-1"], "--max-request-mb"),
        (RETRIEVAL + ["--num-threads", "-2"], "--num-threads"),
        (RETRIEVAL + ["--port", "x"], "--port"),
    ],
)
def test_absurd_server_flags_are_refused_in_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"tandem {argv[0]}: error: argument {flag}"), err
    assert "Traceback" not in "\n".join(err)


def test_sane_server_flags_parse_to_their_values():
    args = build_parser().parse_args(
        ENGINE + ["--max-running-requests", "8", "--max-request-mb", "2.5", "--dtype", "bfloat16"]
    )
    assert (args.max_running_requests, args.max_request_mb, args.dtype) == (8, 2.5, "bfloat16")
    assert build_parser().parse_args(RETRIEVAL + ["--num-threads", "0"]).num_threads == 0
