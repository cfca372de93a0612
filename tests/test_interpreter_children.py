"""The test helper that runs a module's interpreter cases in a child process (helpers.InterpreterCases): what it
returns, what it reports when the child fails, and that it runs each child once however many threads ask."""

import sys
import threading

import pytest

from helpers import InterpreterCases, run_interpreter_children_in_background

CHILD = """
import json, os, sys
with open(sys.argv[1], "a") as log:
    log.write("run\\n")
if sys.argv[2] == "crash":
    sys.exit("the child failed before any case")
print("not a case line")
for name in sys.argv[2:]:
    print("CASE " + json.dumps({"name": name, "interpret": os.environ["TRITON_INTERPRET"], "argv": sys.argv[2:]}))
"""


def _child(tmp_path, *names) -> tuple[InterpreterCases, object]:
    script, log = tmp_path / "child.py", tmp_path / "runs.log"
    script.write_text(CHILD)
    return InterpreterCases(script, [str(log), *names], timeout=60), log


def test_results_are_the_case_lines_of_one_child_under_the_interpreter(tmp_path):
    cases, log = _child(tmp_path, "a", "b")
    threads = [threading.Thread(target=cases.run) for _ in range(3)]
    for t in threads:
        t.start()
    results = cases.results()
    for t in threads:
        t.join()
    assert set(results) == {"a", "b"}
    assert results["a"] == {"interpret": "1", "argv": ["a", "b"]}
    assert log.read_text() == "run\n"                 # four callers, one child
    assert cases.results() == results and log.read_text() == "run\n"


def test_a_child_that_reports_nothing_fails_the_test_with_its_stderr(tmp_path):
    cases, _ = _child(tmp_path, "crash")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)produced no results \(rc=1\).*failed before any case"):
        cases.results()


def test_a_stopped_child_never_starts(tmp_path):
    cases, log = _child(tmp_path, "a")
    cases.stop()
    with pytest.raises(pytest.fail.Exception, match="stopped before it ran"):
        cases.results()
    assert not log.exists()


def test_a_child_past_its_timeout_is_killed_and_named(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(30)\n")
    cases = InterpreterCases(script, [], timeout=1)
    with pytest.raises(pytest.fail.Exception, match="killed after its timeout of 1 s"):
        cases.results()


def test_background_children_run_in_order_and_results_wait_for_them(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first, log1 = _child(tmp_path / "one", "x")
    second, log2 = _child(tmp_path / "two", "y")
    thread = run_interpreter_children_in_background([first, second])
    assert second.results()["y"]["argv"] == ["y"]
    thread.join(timeout=60)
    assert not thread.is_alive() and log1.read_text() == log2.read_text() == "run\n"
    assert first.results()["x"]["interpret"] == "1"


def test_the_child_runs_this_python(tmp_path):
    script = tmp_path / "which.py"
    script.write_text('import json, sys\nprint("CASE " + json.dumps({"name": "exe", "path": sys.executable}))\n')
    assert InterpreterCases(script, []).results()["exe"]["path"] == sys.executable


def test_the_child_gets_the_environment_of_collection_not_of_a_test_running_beside_it(tmp_path, monkeypatch):
    # a background child can start while a test has monkeypatched os.environ
    script = tmp_path / "env.py"
    script.write_text('import json, os\nprint("CASE " + json.dumps({"name": "env", "probe": os.environ.get("VS_PROBE"),'
                      ' "interpret": os.environ["TRITON_INTERPRET"]}))\n')
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cases = InterpreterCases(script, [])
    monkeypatch.setenv("VS_PROBE", "set by a later test")
    assert cases.results()["env"] == {"probe": None, "interpret": "1"}
