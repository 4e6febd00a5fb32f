//! Reading `HP_EMU_*` numbers: a value that does not parse is remembered, so the emulator's
//! initialisation can fail instead of guessing.

#[derive(Default)]
pub struct EnvReader {
    pub malformed: bool,
}

impl EnvReader {
    /// The variable's value, or `default` when it is not set.
    pub fn num(&mut self, name: &str, default: u64) -> u64 {
        match std::env::var(name) {
            Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                self.malformed = true;
                default
            }),
            Err(std::env::VarError::NotPresent) => default,
            Err(_) => {
                self.malformed = true;
                default
            }
        }
    }

    /// `HP_EMU_DELAY_SEED`: `Some` only when set.
    pub fn delay_seed(&mut self) -> Option<u64> {
        std::env::var_os("HP_EMU_DELAY_SEED").map(|_| self.num("HP_EMU_DELAY_SEED", 0))
    }
}
