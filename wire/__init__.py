"""ddiloco.wire: what learners and the synchronizer both speak, imported by both sides and
importing neither: the protocol (protocol.py), safetensors payloads (codec.py), update
encodings and quantization (encodings.py, quant.py), the download format (broadcast.py), the
job's status from its shards' (job_status.py), credentials (auth.py), TLS (tls.py) and the
errors they raise (errors.py)."""
