"""ddiloco.wire: what learners and the synchronizer both speak: the protocol, payloads, encodings, credentials, TLS."""
