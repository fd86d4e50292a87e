"""Streaming chat over gRPC through the ensemble (tritonclient).

    .venv/bin/python client_examples/grpc_stream_chat.py --url localhost:8001 "Write a haiku about the sea."

(tritonclient lives in the venv: run it with the venv's interpreter, or activate the venv first.)
"""

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("prompt", nargs="?", default="Write a haiku about the sea.")
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()

    messages = [{"role": "user", "content": args.prompt}]
    inputs = [
        tensor("messages", np.array([json.dumps(messages).encode()], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([args.max_tokens], dtype=np.int32), "INT32"),
        tensor("temperature", np.array([args.temperature], dtype=np.float32), "FP32"),
        tensor("stream", np.array([True]), "BOOL"),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=600)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            resp = result.get_response()
            if resp.outputs:
                sys.stdout.write(result.as_numpy("text_output")[0].decode("utf-8"))
                sys.stdout.flush()
            if resp.parameters["triton_final_response"].bool_param:
                finish = result.as_numpy("finish_reason")[0].decode() if resp.outputs else ""
                print(f"\n[finish_reason={finish or 'n/a'}]")
                return 0
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
