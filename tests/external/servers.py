"""Servers for the served external source's tests: the real `transformers serve` on the embedded tiny AR model,
and a hostile stand-in for what a real server will not do on demand (refuse, fail, stall, return garbage).

The real servers' launchers are `dllm_rl.external.local_server`'s. The stand-in answers like `transformers serve`
does when it works (the same routes, a 400 naming the pinned model for any other, `logprobs: null`), so the
source cannot tell them apart until it is told to misbehave."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_AR = ROOT / "models" / "tiny-ar"


class Hostile:
    """An OpenAI-compatible stand-in serving `model`; `mode` says how it answers completions from now on:
    ok | error500 | stall | drip | garbage | truncated | no_choices | empty | unauthorized (`drip`: a 200 whose
    body comes one byte every `drip_s`). `fail_first` answers that many completion requests with HTTP 500 before
    following `mode`; `logprobs` (a list) makes it return them, with `tokens` as the token strings (else t0, t1...).
    It counts the completion requests and keeps their Authorization headers (`keys`)."""

    def __init__(self, model: str = "stub", text: str = "<answer>0</answer>", stall_s: float = 5.0):
        self.model, self.text, self.stall_s = model, text, stall_s
        self.mode, self.fail_first, self.requests, self.keys = "ok", 0, 0, []
        self.logprobs: list[float] | None = None
        self.tokens: list[str] | None = None
        self.drip_s = 0.5
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    return self.send(200, {"object": "list", "data": [{"id": owner.model, "object": "model"}]})
                if self.path == "/health":
                    return self.send(200, {"status": "ok"})
                self.send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with owner.lock:
                    owner.requests += 1
                    owner.keys.append(self.headers.get("Authorization"))
                    failing = owner.fail_first > 0
                    owner.fail_first -= failing
                if body.get("model") != owner.model:
                    pinned = f"Server is pinned to {owner.model!r}; requested {body.get('model')!r}."
                    return self.send(400, {"detail": pinned})
                mode = "error500" if failing else owner.mode
                if mode == "stall":
                    time.sleep(owner.stall_s)
                if mode == "error500":
                    return self.send(500, {"detail": "Internal Server Error"})
                if mode == "unauthorized":
                    return self.send(401, {"error": {"message": "Invalid API key"}})
                if mode == "garbage":
                    return self.raw(200, b"<html>502 Bad Gateway</html>{")
                if mode == "truncated":
                    return self.raw(200, json.dumps(owner.reply("x" * 40)).encode()[:37])
                if mode == "no_choices":
                    return self.send(200, {"id": "c", "object": "text_completion", "choices": []})
                chat = self.path.rstrip("/").endswith("/chat/completions")
                if mode == "drip":
                    return self.raw(200, json.dumps(owner.reply(owner.text, chat)).encode(), drip_s=owner.drip_s)
                self.send(200, owner.reply("" if mode == "empty" else owner.text, chat))

            def send(self, status, obj):
                self.raw(status, json.dumps(obj).encode())

            def raw(self, status, data, drip_s=0.0):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for k in range(len(data)) if drip_s else []:
                        self.wfile.write(data[k:k + 1])
                        self.wfile.flush()
                        time.sleep(drip_s)
                    self.wfile.write(b"" if drip_s else data)
                except OSError:  # the client gave up (a stalled request past its timeout)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def reply(self, text: str, chat: bool = False) -> dict:
        """A completion as `transformers serve` writes it (`logprobs: null`), or with `self.logprobs` (per-token
        log-probs) as vLLM writes them."""
        lps = self.logprobs
        names = self.tokens or [f"t{k}" for k in range(len(lps or []))]
        if chat:
            logprobs = None if lps is None else {"content": [{"token": names[k], "logprob": lp, "bytes": None,
                                                              "top_logprobs": []} for k, lp in enumerate(lps)]}
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                      "logprobs": logprobs}
        else:
            logprobs = None if lps is None else {"tokens": names, "token_logprobs": lps,
                                                 "top_logprobs": None, "text_offset": list(range(len(lps)))}
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": logprobs}
        return {"id": "c", "object": "chat.completion" if chat else "text_completion", "created": 0,
                "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def stop(self) -> None:
        """Gone: the port refuses connections from now on."""
        self.server.shutdown()
        self.server.server_close()
