"""Reliability campaign: load, soak, faults and fuzz legs, each writing a JSON and an HTML report."""
