"""The model repository: Triton's config schema (config), configs generated from the specs with layouts by kind
(generate), profiles, config variants and the NGC views, the native-load check, and the CPU runtime choice."""
