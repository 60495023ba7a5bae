"""`appliance data check`: the data quality gate.

One concern per module: scan (one file's streaming pass), image_probe (decode + measure),
schema, outliers (3-sigma and median/MAD), duplicates (exact, near, leakage), balance, gate,
quarantine, report_json, report_html + plots + thumbnails, run (orchestration), cli.
"""
