//! A small interpreter of the PTX subset `gather.ptx` uses, so that tests run the gather
//! kernel without a GPU: each thread of each block runs alone to its `ret` (the kernel's
//! threads share nothing and write disjoint bytes, so running them one after another computes
//! what a GPU does), over a flat memory that refuses an access outside it or one that is not
//! naturally aligned (a GPU faults on both). An instruction it does not know fails the test:
//! extend it together with the kernel.

use std::collections::HashMap;

#[derive(Debug, Clone)]
enum Arg {
    Reg(usize),
    Imm(u64),
    Special(&'static str),
    /// `[reg + offset]`, or `[param]` (the param's index, with `param: true`).
    Mem {
        reg: usize,
        off: u64,
        param: Option<usize>,
    },
    Vec4([usize; 4]),
    Label(usize),
}

#[derive(Debug, Clone)]
struct Inst {
    guard: Option<(usize, bool)>,
    op: String,
    args: Vec<Arg>,
}

/// A thread's place in the grid: block, blocks, thread, threads per block.
#[derive(Debug, Clone, Copy)]
struct Ids {
    b: u64,
    nb: u64,
    t: u64,
    nt: u64,
}

pub struct Kernel {
    insts: Vec<Inst>,
    regs: usize,
}

impl Kernel {
    /// The entry point `entry` of `ptx`, whose parameters are named `params` in order.
    pub fn parse(ptx: &str, entry: &str, params: &[&str]) -> Kernel {
        let body = ptx
            .split_once(&format!(".entry {entry}("))
            .and_then(|(_, e)| e.split_once('{'))
            .map(|(_, b)| b)
            .unwrap_or_else(|| panic!("no entry {entry} with a body"));
        let lines: Vec<String> = body
            .lines()
            .map(|l| l.split("//").next().unwrap_or("").trim().to_string())
            .take_while(|l| l != "}")
            .filter(|l| !l.is_empty() && !l.starts_with(".reg"))
            .collect();
        let mut labels = HashMap::new();
        let mut n = 0;
        for l in &lines {
            if let Some(name) = l.strip_suffix(':') {
                labels.insert(name.to_string(), n);
            } else {
                n += 1;
            }
        }
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut reg = |name: &str| {
            let next = names.len();
            *names.entry(name.to_string()).or_insert(next)
        };
        let mut insts = Vec::new();
        for l in lines.iter().filter(|l| !l.ends_with(':')) {
            let l = l.trim_end_matches(';');
            let (guard, rest) = match l.strip_prefix('@') {
                Some(g) => {
                    let (p, rest) = g.split_once(char::is_whitespace).expect("guarded op");
                    let (neg, p) = p.strip_prefix('!').map_or((false, p), |p| (true, p));
                    (Some((reg(p), !neg)), rest.trim())
                }
                None => (None, l),
            };
            let (op, operands) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            let mut args = Vec::new();
            let mut text = operands.trim();
            while !text.is_empty() {
                let (tok, more) = if text.starts_with('{') {
                    let end = text.find('}').expect("}") + 1;
                    (&text[..end], &text[end..])
                } else {
                    text.split_once(',').unwrap_or((text, ""))
                };
                text = more.trim_start_matches(',').trim();
                let tok = tok.trim();
                args.push(if let Some(v) = tok.strip_prefix('{') {
                    let r: Vec<usize> = v.trim_end_matches('}').split(',').map(|r| reg(r.trim())).collect();
                    Arg::Vec4([r[0], r[1], r[2], r[3]])
                } else if let Some(m) = tok.strip_prefix('[') {
                    let m = m.trim_end_matches(']');
                    match params.iter().position(|p| *p == m) {
                        Some(i) => Arg::Mem { reg: 0, off: 0, param: Some(i) },
                        None => {
                            let (r, off) = m.split_once('+').unwrap_or((m, "0"));
                            Arg::Mem { reg: reg(r), off: off.parse().expect("offset"), param: None }
                        }
                    }
                } else if let Some(s) =
                    ["%ctaid.x", "%nctaid.x", "%tid.x", "%ntid.x"].iter().find(|s| **s == tok)
                {
                    Arg::Special(s)
                } else if tok.starts_with('%') {
                    Arg::Reg(reg(tok))
                } else if tok.starts_with('$') {
                    Arg::Label(*labels.get(tok).unwrap_or_else(|| panic!("label {tok}")))
                } else {
                    Arg::Imm(tok.parse().unwrap_or_else(|_| panic!("operand {tok:?} of {l}")))
                });
            }
            insts.push(Inst { guard, op: op.to_string(), args });
        }
        Kernel { insts, regs: names.len() }
    }

    /// Runs the kernel on a grid of `blocks` x `threads` with `params`, over `mem` (which
    /// holds the bytes at addresses `base..base + mem.len()`). Returns instructions run.
    pub fn run(&self, blocks: u64, threads: u64, params: &[u64], mem: &mut [u8], base: u64) -> u64 {
        let mut steps = 0;
        for b in 0..blocks {
            for t in 0..threads {
                steps += self.thread(Ids { b, nb: blocks, t, nt: threads }, params, mem, base);
            }
        }
        steps
    }

    fn thread(&self, ids: Ids, params: &[u64], mem: &mut [u8], base: u64) -> u64 {
        let Ids { b, nb, t, nt } = ids;
        let mut r = vec![0u64; self.regs];
        let len = mem.len() as u64;
        let at = |addr: u64, width: u64| -> usize {
            assert_eq!(addr % width, 0, "a {width}-byte access at {addr:#x} is not aligned");
            let off = addr.checked_sub(base).expect("below memory");
            assert!(off + width <= len, "an access at {addr:#x} past memory");
            off as usize
        };
        let mut pc = 0;
        let mut steps = 0;
        loop {
            let i = &self.insts[pc];
            pc += 1;
            steps += 1;
            assert!(steps < 100_000_000, "runaway thread");
            if let Some((p, want)) = i.guard
                && (r[p] != 0) != want
            {
                continue;
            }
            let val = |a: &Arg, r: &[u64]| match a {
                Arg::Reg(x) => r[*x],
                Arg::Imm(v) => *v,
                Arg::Special(s) => match *s {
                    "%ctaid.x" => b,
                    "%nctaid.x" => nb,
                    "%tid.x" => t,
                    _ => nt,
                },
                other => panic!("not a value: {other:?}"),
            };
            let dst = |a: &Arg| match a {
                Arg::Reg(x) => *x,
                other => panic!("not a register: {other:?}"),
            };
            let addr = |a: &Arg, r: &[u64]| match a {
                Arg::Mem { reg, off, param: None } => r[*reg] + off,
                other => panic!("not a memory operand: {other:?}"),
            };
            let width = |op: &str| match op.rsplit('.').next() {
                Some("u8") => 1,
                Some("u32") if op.contains(".v4.") => 16,
                Some("u32") => 4,
                _ => 8,
            };
            let op = i.op.as_str();
            let a = &i.args;
            match op {
                "ret" => return steps,
                "bra" | "bra.uni" => match a[0] {
                    Arg::Label(l) => pc = l,
                    _ => panic!("bra without a label"),
                },
                "ld.param.u64" => match a[1] {
                    Arg::Mem { param: Some(p), .. } => r[dst(&a[0])] = params[p],
                    _ => panic!("ld.param of no param"),
                },
                "cvta.to.global.u64" | "mov.u64" | "cvt.u64.u32" => r[dst(&a[0])] = val(&a[1], &r),
                "mov.u32" => r[dst(&a[0])] = val(&a[1], &r) & 0xffff_ffff,
                "mul.lo.u64" => r[dst(&a[0])] = val(&a[1], &r).wrapping_mul(val(&a[2], &r)),
                "add.u64" => r[dst(&a[0])] = val(&a[1], &r).wrapping_add(val(&a[2], &r)),
                "sub.u64" => r[dst(&a[0])] = val(&a[1], &r).wrapping_sub(val(&a[2], &r)),
                "div.u64" => {
                    let d = val(&a[2], &r);
                    assert_ne!(d, 0, "a division by zero");
                    r[dst(&a[0])] = val(&a[1], &r) / d;
                }
                "xor.b64" => r[dst(&a[0])] = val(&a[1], &r) ^ val(&a[2], &r),
                "and.b64" => r[dst(&a[0])] = val(&a[1], &r) & val(&a[2], &r),
                "min.u64" => r[dst(&a[0])] = val(&a[1], &r).min(val(&a[2], &r)),
                "neg.s64" => r[dst(&a[0])] = val(&a[1], &r).wrapping_neg(),
                "not.b64" => r[dst(&a[0])] = !val(&a[1], &r),
                "shl.b64" => r[dst(&a[0])] = val(&a[1], &r) << (val(&a[2], &r) & 63),
                "setp.ge.u64" => r[dst(&a[0])] = u64::from(val(&a[1], &r) >= val(&a[2], &r)),
                "setp.eq.u64" => r[dst(&a[0])] = u64::from(val(&a[1], &r) == val(&a[2], &r)),
                "setp.ne.s64" => r[dst(&a[0])] = u64::from(val(&a[1], &r) != val(&a[2], &r)),
                _ if op.starts_with("ld.global.") => {
                    let w = width(op);
                    let o = at(addr(&a[1], &r), w);
                    match &a[0] {
                        Arg::Vec4(v) => {
                            for (k, x) in v.iter().enumerate() {
                                let b4: [u8; 4] = mem[o + 4 * k..o + 4 * k + 4].try_into().expect("4");
                                r[*x] = u64::from(u32::from_le_bytes(b4));
                            }
                        }
                        d => {
                            let mut b8 = [0u8; 8];
                            b8[..w as usize].copy_from_slice(&mem[o..o + w as usize]);
                            r[dst(d)] = u64::from_le_bytes(b8);
                        }
                    }
                }
                _ if op.starts_with("st.global.") => {
                    let w = width(op);
                    let o = at(addr(&a[0], &r), w);
                    match &a[1] {
                        Arg::Vec4(v) => {
                            for (k, x) in v.iter().enumerate() {
                                mem[o + 4 * k..o + 4 * k + 4].copy_from_slice(&(r[*x] as u32).to_le_bytes());
                            }
                        }
                        s => {
                            let bytes = val(s, &r).to_le_bytes();
                            mem[o..o + w as usize].copy_from_slice(&bytes[..w as usize]);
                        }
                    }
                }
                other => panic!("the simulator does not know {other} (extend it with the kernel)"),
            }
        }
    }
}
