"""The test harness that runs inside the sandbox: it imports the program, runs the tests, reports.

Not imported by the trainer: ``rewards/code.py`` copies this file into the sandbox as
``harness.py`` next to ``solution.py`` (the program) and ``spec.json`` (the tests), and runs
``python -I -B harness.py``. Standard library only, and plain syntax, so any Python 3 runs it.

Pass/fail is decided here and reported through a channel the program cannot forge, never by the
exit status: before any program code runs, the harness reads a per-run random token from an
inherited pipe (``MRL_SECRET_FD``, then closed) and deletes ``spec.json`` (so the program cannot
read the tests from disk). It then executes the program as module ``solution`` (``__name__`` is
not ``"__main__"``: a ``main()`` guard does not run), runs the tests in that module's namespace,
and only after the last one writes ``<token> <json report>`` to the result file
(``MRL_RESULT_FD``), after killing every other process of the sandbox's PID namespace (so none
can race to rewrite the report), and leaves with ``os._exit`` (the program's atexit hooks never
run). A program
that ends the process early in any way (``sys.exit``, ``os._exit``, a signal to itself, exec of
another program, a closed stdout, an exception) leaves no report, or a report that is not a pass:
the caller counts that as failed.

The token lives only in this process's memory while the program runs; a program written to search
the harness's own frames for it could find it (a targeted attack on this file, not an accident),
which is why the tests' expected values for call-based cases never enter the sandbox at all: those
results are compared by the caller.
"""

import json
import os
import signal
import sys
import types

_REPORT_LIMIT = 500


def _describe(exc):
    try:
        text = "%s: %s" % (type(exc).__name__, exc)
    except BaseException:  # a program-defined exception whose str() fails
        text = "exception"
    return text[:_REPORT_LIMIT]


def _run(kind, spec, program, dumps):
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    namespace = module.__dict__
    stage = "program"
    try:
        exec(compile(spec.get("prelude", ""), "prelude.py", "exec"), namespace)
        exec(compile(program, "solution.py", "exec"), namespace)
        stage = "tests"
        if kind == "assert":
            exec(compile(spec["tests"], "tests.py", "exec"), namespace)
            return {"status": "pass"}
        if kind == "call":
            name = spec["fn_name"]
            solution = namespace.get("Solution")
            if solution is not None and hasattr(solution, name):
                fn = getattr(solution(), name)
            else:
                fn = namespace[name]
            result = fn(*spec["args"])
            stage = "result"
            return {"status": "pass", "result": dumps(result)}
        return {"status": "error", "stage": "harness", "error": "unknown kind %r" % (kind,)}
    except SystemExit as exc:
        return {"status": "exited", "stage": stage, "error": "SystemExit(%r)" % (exc.code,)}
    except BaseException as exc:
        return {"status": "error", "stage": stage, "error": _describe(exc)}


def main():
    # Bound before the program runs, so that replacing os.write & co. changes nothing here.
    write, exit_now, dumps, read, close = os.write, os._exit, json.dumps, os.read, os.close
    kill, sigkill = os.kill, signal.SIGKILL
    secret_fd = int(os.environ.pop("MRL_SECRET_FD"))
    result_fd = int(os.environ.pop("MRL_RESULT_FD"))
    own_pid_namespace = os.environ.pop("MRL_OWN_PID_NAMESPACE", "") == "1" and os.getpid() < 16
    token = b""
    while True:
        chunk = read(secret_fd, 4096)
        if not chunk:
            break
        token += chunk
    close(secret_fd)
    with open("spec.json") as f:
        spec = json.load(f)
    os.unlink("spec.json")
    with open("solution.py") as f:
        program = f.read()
    report = _run(sys.argv[1], spec, program, dumps)
    try:
        line = dumps(report)
    except BaseException as exc:
        line = dumps({"status": "error", "stage": "report", "error": _describe(exc)})
    if own_pid_namespace:
        # No process the program started may outlive the report and race to rewrite it: in the
        # sandbox's own PID namespace, kill(-1) reaches exactly them (never init, never us).
        try:
            kill(-1, sigkill)
        except OSError:
            pass
    write(result_fd, token + b" " + line.encode("utf-8", "replace") + b"\n")
    exit_now(0)


if __name__ == "__main__":
    main()
