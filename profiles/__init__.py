"""Built-in hardware data (hardware/*.yaml) and measured layer profiles (measured/*.json); see README.md."""
