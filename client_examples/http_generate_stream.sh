#!/usr/bin/env bash
# Triton's HTTP generate_stream endpoint (server-sent events), one JSON event per engine step.
#   bash client_examples/http_generate_stream.sh [HOST:HTTP_PORT]
# Streaming needs this endpoint: "stream": true sent to /generate instead reaches the models exactly
# like this request (they cannot tell the two apart), so the reply is generated in full and Triton then
# answers 200 with an error body ("generate expects model to produce exactly 1 response").
URL=${1:-localhost:8000}
curl -sN -X POST "http://$URL/v2/models/ensemble/generate_stream" \
  -H 'Content-Type: application/json' \
  -d '{"text_input": "Write a haiku about the sea.", "apply_chat_template": true, "max_tokens": 64, "stream": true}'
echo
