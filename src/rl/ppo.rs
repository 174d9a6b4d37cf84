//! The PPO-clip token loss in plain f64: the reference definition that the
//! compute engine's candle implementation is tested against.
//!
//! For tokens t with log-probabilities under the policy being trained
//! (`logp_new`) and under the policy that generated the rollouts
//! (`logp_old`), advantage `A_t` and mask weight `m_t`:
//!
//! ```text
//! ρ_t  = exp(logp_new_t − logp_old_t)
//! ℓ_t  = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε, 1 + ε))
//! loss = Σ_t m_t·ℓ_t / Σ_t m_t          (token mean over the whole batch; 0 if Σ m = 0)
//! ```
//!
//! AZR's settings: ε = 0.2, no KL term, gradient-norm clipping at 1.0 (the
//! optimizer applies it). Tokens with `m_t = 0` are skipped entirely, so
//! padding may hold any value, even −∞; a token with `A_t = 0` contributes 0.

use super::Error;

/// PPO clip range ε (AZR).
pub const AZR_PPO_CLIP: f64 = 0.2;
/// Global gradient-norm clip (AZR).
pub const AZR_GRAD_CLIP_NORM: f64 = 1.0;

/// The token-mean PPO-clip loss (see the module doc).
pub fn ppo_clip_token_loss(
    logp_new: &[f64],
    logp_old: &[f64],
    adv: &[f64],
    mask: &[f64],
    clip: f64,
) -> Result<f64, Error> {
    let tokens = checked_tokens("ppo_clip_token_loss", logp_new, logp_old, adv, mask, clip)?;
    let (mut weighted, mut total) = (0.0, 0.0);
    for t in tokens {
        weighted += mask[t] * token_loss(logp_new[t] - logp_old[t], adv[t], clip);
        total += mask[t];
    }
    Ok(if total == 0.0 { 0.0 } else { weighted / total })
}

/// The gradient of [`ppo_clip_token_loss`] with respect to each `logp_new`.
/// Where the clipped term is the larger one the gradient is 0; at a tie (ρ
/// inside the clip range, or exactly on its edge) the unclipped branch is
/// taken, whose derivative is `−A_t·ρ_t`.
pub fn ppo_clip_token_loss_grad(
    logp_new: &[f64],
    logp_old: &[f64],
    adv: &[f64],
    mask: &[f64],
    clip: f64,
) -> Result<Vec<f64>, Error> {
    let tokens = checked_tokens(
        "ppo_clip_token_loss_grad",
        logp_new,
        logp_old,
        adv,
        mask,
        clip,
    )?;
    let total: f64 = tokens.iter().map(|&t| mask[t]).sum();
    let mut grad = vec![0.0; logp_new.len()];
    if total == 0.0 {
        return Ok(grad);
    }
    for t in tokens {
        let (_, d) = token_loss_and_grad(logp_new[t] - logp_old[t], adv[t], clip);
        grad[t] = mask[t] * d / total;
    }
    Ok(grad)
}

/// One token's `ℓ_t` and its derivative with respect to `logp_new_t`:
/// `−A_t·ρ_t` where the unclipped term is the larger one (ties included), 0
/// where the clipped term is (it is constant in ρ there).
pub fn token_loss_and_grad(log_ratio: f64, a: f64, clip: f64) -> (f64, f64) {
    if a == 0.0 {
        return (0.0, 0.0); // avoids 0·∞ when the ratio overflows
    }
    let ratio = log_ratio.exp();
    let unclipped = -a * ratio;
    let clipped = -a * ratio.clamp(1.0 - clip, 1.0 + clip);
    if unclipped >= clipped {
        (unclipped, unclipped)
    } else {
        (clipped, 0.0)
    }
}

fn token_loss(log_ratio: f64, a: f64, clip: f64) -> f64 {
    token_loss_and_grad(log_ratio, a, clip).0
}

/// Validates the inputs and returns the indices of tokens with nonzero mask.
fn checked_tokens(
    what: &'static str,
    logp_new: &[f64],
    logp_old: &[f64],
    adv: &[f64],
    mask: &[f64],
    clip: f64,
) -> Result<Vec<usize>, Error> {
    if !(clip.is_finite() && clip >= 0.0) {
        return Err(Error::BadSetting {
            name: "ppo.clip",
            value: clip,
            rule: "finite and >= 0",
        });
    }
    let expected = logp_new.len();
    for (name, values) in [("logp_old", logp_old), ("adv", adv), ("mask", mask)] {
        if values.len() != expected {
            return Err(Error::LengthMismatch {
                what,
                name,
                got: values.len(),
                expected,
            });
        }
    }
    let mut tokens = Vec::new();
    for (t, &m) in mask.iter().enumerate() {
        if !(m.is_finite() && m >= 0.0) {
            return Err(Error::NonFinite {
                what,
                name: "mask",
                index: t,
                value: m,
            });
        }
        if m == 0.0 {
            continue;
        }
        for (name, values) in [("logp_new", logp_new), ("logp_old", logp_old), ("adv", adv)] {
            if !values[t].is_finite() {
                return Err(Error::NonFinite {
                    what,
                    name,
                    index: t,
                    value: values[t],
                });
            }
        }
        tokens.push(t);
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_policies_give_minus_mean_advantage() {
        let lp = [-1.0, -2.0, -0.5];
        let loss = ppo_clip_token_loss(&lp, &lp, &[1.0, -2.0, 4.0], &[1.0, 1.0, 0.0], 0.2).unwrap();
        assert!((loss - 0.5).abs() < 1e-12); // −(1 − 2)/2
    }

    #[test]
    fn clipping_caps_the_gain_of_positive_advantages() {
        // ρ = e ≈ 2.72 > 1.2 with A = 1: the clipped term −1.2 is the max.
        let loss = ppo_clip_token_loss(&[1.0], &[0.0], &[1.0], &[1.0], 0.2).unwrap();
        assert!((loss + 1.2).abs() < 1e-12);
        let grad = ppo_clip_token_loss_grad(&[1.0], &[0.0], &[1.0], &[1.0], 0.2).unwrap();
        assert_eq!(grad, vec![0.0]);
        // With A = −1 the unclipped term −A·ρ = e is larger: no clipping.
        let loss = ppo_clip_token_loss(&[1.0], &[0.0], &[-1.0], &[1.0], 0.2).unwrap();
        assert!((loss - 1f64.exp()).abs() < 1e-12);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let new = [-0.9, -2.05, -0.3, -1.5, -0.7];
        let old = [-1.0, -2.0, -0.5, -1.5, -0.2];
        let adv = [1.0, -0.5, 2.0, 0.0, -1.0];
        let mask = [1.0, 1.0, 1.0, 1.0, 0.0];
        let grad = ppo_clip_token_loss_grad(&new, &old, &adv, &mask, 0.2).unwrap();
        let h = 1e-6;
        for t in 0..new.len() {
            let (mut up, mut down) = (new, new);
            up[t] += h;
            down[t] -= h;
            let numeric = (ppo_clip_token_loss(&up, &old, &adv, &mask, 0.2).unwrap()
                - ppo_clip_token_loss(&down, &old, &adv, &mask, 0.2).unwrap())
                / (2.0 * h);
            assert!(
                (numeric - grad[t]).abs() < 1e-6,
                "token {t}: {numeric} vs {}",
                grad[t]
            );
        }
    }

    #[test]
    fn masked_padding_and_bad_inputs() {
        let loss = ppo_clip_token_loss(&[f64::NEG_INFINITY], &[0.0], &[1.0], &[0.0], 0.2).unwrap();
        assert_eq!(loss, 0.0);
        assert!(matches!(
            ppo_clip_token_loss(&[0.0, 0.0], &[0.0], &[1.0, 1.0], &[1.0, 1.0], 0.2),
            Err(Error::LengthMismatch {
                name: "logp_old",
                ..
            })
        ));
        assert!(matches!(
            ppo_clip_token_loss(&[f64::NAN], &[0.0], &[1.0], &[1.0], 0.2),
            Err(Error::NonFinite {
                name: "logp_new",
                ..
            })
        ));
        assert!(ppo_clip_token_loss(&[0.0], &[0.0], &[1.0], &[1.0], -0.1).is_err());
    }
}
