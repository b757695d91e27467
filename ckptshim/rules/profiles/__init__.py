"""Named model profiles: renames a model family needs, as ckptshim rules.

Where a framework already publishes its own rename table (transformers' checkpoint conversion
mapping), the profile is read from it at load time rather than copied here, so it never goes
stale; see :mod:`.transformers_mapping`.
"""
