//! The control protocol's request decoder: any bytes give a request or an
//! error, never a panic; a request re-encodes to a line that decodes to
//! the same request; an error encodes to a reply line.

#![no_main]

use libfuzzer_sys::fuzz_target;
use udm_control::{decode, Reply};

fuzz_target!(|data: &[u8]| {
    match decode(data) {
        Ok(req) => {
            let line = req.to_line().expect("a decoded request encodes");
            let again = decode(line.trim_end().as_bytes()).expect("an encoded request decodes");
            assert_eq!(again, req);
        }
        Err((id, e)) => {
            let line = Reply::from_result(id, Err(e)).to_line();
            assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        }
    }
});
