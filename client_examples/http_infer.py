"""Non-streaming request over HTTP (Triton's generate endpoint: one JSON answer).

Triton's /infer endpoints refuse models with a decoupled step (the engine is decoupled), so
non-streaming HTTP clients use /generate; gRPC clients send stream=false on a stream.

    python client_examples/http_infer.py --url localhost:8000 "The capital of France is"
"""

import argparse
import json
import sys
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("prompt", nargs="?", default="The capital of France is")
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "return_finish_reason": True}
    req = urllib.request.Request(f"http://{args.url}/v2/models/ensemble/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    print(out["text_output"])
    print(f"[{out['num_input_tokens']} prompt tokens, {out['num_output_tokens']} generated, "
          f"finish_reason={out['finish_reason']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
