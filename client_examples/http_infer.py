"""Non-streaming request over HTTP (Triton's generate endpoint: one JSON answer).

Triton's /infer endpoints refuse models with a decoupled step (the engine is decoupled), so
non-streaming HTTP clients use /generate; gRPC clients send stream=false on a stream.

Never send "stream": true to /generate: Triton hands the models exactly the same request on
/generate and on /generate_stream, so they cannot refuse it up front; the whole reply is generated
and Triton then answers 200 with an error body ("generate expects model to produce exactly 1
response"). Stream with /generate_stream instead (client_examples/http_generate_stream.sh).
A non-streaming request may ask at most `max_nonstream_tokens` tokens (server parameter, default
4096): Triton does not tell the server when a /generate client goes away, so the server bounds it.

    .venv/bin/python client_examples/http_infer.py --url localhost:8000 "The capital of France is"
    .venv/bin/python client_examples/http_infer.py --url localhost:8000 --chat "Name three colours."

(Only the standard library: any python3 runs it.) With --chat the prompt goes as a chat message: over HTTP each
input is the JSON value of its tensor, and `messages` is a string tensor, so the body carries the message list as
a JSON *string* (json.dumps); a bare array gets a 500 from Triton's JSON parser before any model sees it.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("prompt", nargs="?", default="The capital of France is")
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template applied)")
    args = p.parse_args()
    body = {"max_tokens": args.max_tokens, "return_finish_reason": True}
    if args.chat:
        body["messages"] = json.dumps([{"role": "user", "content": args.prompt}])
    else:
        body["text_input"] = args.prompt
    req = urllib.request.Request(f"http://{args.url}/v2/models/ensemble/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:  # bad input: the error names the input or limit
        print(f"error {e.code}: {json.loads(e.read()).get('error')}", file=sys.stderr)
        return 1
    if "error" in out:  # an error after the reply started (e.g. "stream": true on /generate)
        print(f"error: {out['error']}", file=sys.stderr)
        return 1
    print(out["text_output"])
    print(f"[{out['num_input_tokens']} prompt tokens, {out['num_output_tokens']} generated, "
          f"finish_reason={out['finish_reason']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
