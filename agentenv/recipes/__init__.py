"""The scripts that built the bundled tiny models (``agentenv/models/tiny-retool``,
``tiny-hermes``) from ``retool-math`` transcripts run in a real sandbox: above the environments
and the sandboxes they use, so the models package under them stays a leaf."""
