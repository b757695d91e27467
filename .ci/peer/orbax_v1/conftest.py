"""absltest parses absl's flags before its tests run; under pytest nothing does, so parse them here."""

from absl import flags

flags.FLAGS(["pytest"], known_only=True)
