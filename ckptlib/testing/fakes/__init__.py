"""Test doubles to test storage code against, without a cloud account: ``s3_server`` (moto),
``emulators`` (fake-gcs-server, Azurite), ``faultproxy`` (503 bursts and outages between a client
and a server) and ``legacy_writers`` (formats ckptlib reads but never writes). All bind 127.0.0.1.

``fixtures`` offers them as pytest fixtures; ``ckptlib.testing.plugin`` registers it.
"""
