import jax

jax.config.update("jax_platforms", "cpu")
