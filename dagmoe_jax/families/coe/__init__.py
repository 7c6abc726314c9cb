"""The Chain-of-Experts family (docs/design.md section 5; CoE eq. 4-10): a router and experts
iterated; its config, block and accounting."""
