"""The OpenAI-compatible server of `pd serve`: `build_app` (app.py) over an EngineClient.

protocol.py parses request bodies, serving.py turns them into engine requests and engine
outputs into text, chat.py renders chat templates, detokenize.py streams text, metrics.py
exposes /metrics, main.py runs it all under uvicorn.
"""
