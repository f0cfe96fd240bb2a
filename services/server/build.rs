// squash.rs embeds each database's retired history, and its tests the migrations themselves
// (sqlx::migrate!): a new file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/lockdb");
    println!("cargo:rerun-if-changed=../../migrations/paydb");
}
