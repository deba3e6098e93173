"""The engine's OpenAI-compatible API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/v1/responses`, and vLLM's `/tokenize`, `/detokenize`, `/version`), apart from the native
protocol: only these routes deal in text, so they own the tokenizer, the chat template and the
tool-call parser. `routes.py` holds the handlers; `request.py` reads a request into a `Plan`
(every field accepted, ignored or refused by name), `chat.py` renders messages and tools,
`choices.py` turns token ids into a choice's text, tool calls and log-probs, `stream.py` sends
them as server-sent events, and `responses.py` reads a Responses request into a chat one and
writes its answer as a response.
"""
