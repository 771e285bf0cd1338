"""The run's configuration: typed sections loaded strictly from YAML plus `section.key=value` overrides.

It sits below training/, planner/ and the tools, which all read the same schema (`config.schema`).
"""
