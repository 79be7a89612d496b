"""Tests of the engine-neutral serving core (shmstore/serving)."""
