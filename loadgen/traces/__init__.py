"""Readers that turn real traces (data/traces/) into conversations a session can replay."""
